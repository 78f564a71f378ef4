"""How Tally's lines say a count (the noun and the verb agreeing with it) and a list."""


def plural(n: int, word: str, many: str | None = None) -> str:
    """"1 step", "2 steps": the count with its noun agreeing (never "step(s)")."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def were(n: int) -> str:
    """The verb agreeing with a count: "was" for 1, else "were"."""
    return "was" if n == 1 else "were"


def listed(items: list, noun: str = "", most: int = 6) -> str:
    """"a", "a and b", "a, b and c"; beyond `most` items the first `most - 1` and how many:
    "a, b, c, d, e, ... (9 hosts)" with `noun` "host"."""
    items = [str(x) for x in items]
    if len(items) > most:
        return f"{', '.join(items[:most - 1])}, ... ({plural(len(items), noun)})"
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
