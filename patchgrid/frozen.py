"""`frozen`: `@dataclass(frozen=True)` at a third of its construction cost, for the value classes a
study makes once or more per patched run (a grid's cells, the engine's requests and their patches,
forwards, readings).

A frozen dataclass's `__init__` sets each field through `object.__setattr__` (its own
`__setattr__` refuses), about 150 ns a field: a 12-field cell costs 1.9 us, as much as a run's
whole step planning in vLLM's worker. The class `frozen` makes is the very dataclass (fields,
equality, hashing, repr, `dataclasses.replace`, pickling, assignment refused), but its `__init__`,
with the same signature, writes the fields into the instance's dictionary directly, as
`object.__setattr__` would: 0.6 us for the same cell. A class with `__post_init__`, `slots`, or a
field outside `__init__` is refused: the `__init__` made here would not run the one, has no instance
dictionary for the other and sets every field; such a class takes `@dataclass(frozen=True)`.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields


def frozen(cls=None, /, **options):
    """`@dataclass(frozen=True, **options)` with a quicker `__init__` (see the module)."""

    def wrap(c):
        c = dataclass(frozen=True, **options)(c)
        if hasattr(c, "__post_init__") or "__slots__" in vars(c):
            raise TypeError(f"{c.__name__}: frozen() writes fields into the instance's dictionary and runs no "
                            "__post_init__; use @dataclass(frozen=True)")
        c.__init__ = _init(c)
        return c

    return wrap if cls is None else wrap(cls)


def _init(cls):
    """An `__init__` with the dataclass's own signature that fills the instance dictionary."""
    env: dict = {"_pg_missing": MISSING}
    positional, keyword, body = [], [], []
    for f in fields(cls):
        if not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: frozen() takes only fields set by __init__")
        param = f.name
        if f.default is not MISSING:
            env[f"_pg_default_{f.name}"] = f.default
            param += f"=_pg_default_{f.name}"
        elif f.default_factory is not MISSING:
            env[f"_pg_factory_{f.name}"] = f.default_factory
            param += "=_pg_missing"
            body.append(f"    if {f.name} is _pg_missing: {f.name} = _pg_factory_{f.name}()")
        (keyword if f.kw_only else positional).append(param)
        body.append(f"    _pg_values[{f.name!r}] = {f.name}")
    params = ", ".join(["self"] + positional + (["*"] + keyword if keyword else []))
    source = f"def __init__({params}):\n    _pg_values = self.__dict__\n" + "\n".join(body) + "\n"
    exec(source, env)  # noqa: S102 - the source is made above from the class's own field names
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    return init
