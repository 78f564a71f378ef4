"""The live API: `tally serve`'s FastAPI app over a ledger it owns.

The public face (`__all__`): `app` (`create_app`), `settings` (`ServeSettings`) and `alerts`
(`Thresholds`); the service, its routes, models, metrics and pages are the API's own."""

__all__ = ["alerts", "app", "settings"]
