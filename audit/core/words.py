"""How Tally's lines say a count: the noun and the verb agreeing with it."""


def plural(n: int, word: str, many: str | None = None) -> str:
    """"1 step", "2 steps": the count with its noun agreeing (never "step(s)")."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def were(n: int) -> str:
    """The verb agreeing with a count: "was" for 1, else "were"."""
    return "was" if n == 1 else "were"
