"""What the pages people read are drawn with: report.html (tally.audit.reconcile.html), diff.html
(tally.audit.posthoc.diff_html) and the live dashboard (tally.api).

- `vocabulary`: chart titles, legend names and order, colours and markers, one for every page
  and the dashboard (served to it).
- `charts`: the SVG chart kit (`Chart`, `bars`, ticks), the pages' CSS, table cells and their
  CSV links.

Arrows: none into the rest of the project (numpy only).
"""

__all__ = ["charts", "vocabulary"]
