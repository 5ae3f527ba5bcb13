"""patchgrid.frozen: a class it makes behaves as @dataclass(frozen=True) makes it, only its __init__ is quicker."""
from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import field

import pytest

from patchgrid.frozen import frozen


def _both(body: dict, **options):
    """The same class body as a plain frozen dataclass and through frozen()."""
    made = []
    for decorate in (dataclasses.dataclass(frozen=True, **options), frozen(**options)):
        made.append(decorate(type("Value", (), dict(body))))
    return made


BODY = {"__annotations__": {"a": "int", "b": "str", "c": "tuple", "d": "list", "e": "int"},
        "b": "x", "c": (), "d": field(default_factory=list, hash=False), "e": field(default=3, kw_only=True)}


@pytest.mark.parametrize("args,kwargs", [((1,), {}), ((1, "y", (2,), [4]), {"e": 5}), ((), {"a": 1, "d": [1]})])
def test_a_frozen_class_is_the_dataclass_it_stands_for(args, kwargs):
    plain, quick = _both(BODY)
    p, q = plain(*args, **kwargs), quick(*args, **kwargs)
    assert inspect.signature(quick).parameters.keys() == inspect.signature(plain).parameters.keys()
    described = [[(f.name, f.default, f.kw_only) for f in dataclasses.fields(c)] for c in (plain, quick)]
    assert described[0] == described[1]
    assert dataclasses.astuple(q) == dataclasses.astuple(p)
    assert repr(q) == repr(p)
    assert hash(quick(1)) == hash(quick(1)) and quick(1) == quick(1) and quick(1) != quick(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.a = 2
    assert dataclasses.replace(q, a=7) == quick(7, *args[1:], **{k: v for k, v in kwargs.items() if k != "a"})


def test_each_instance_gets_its_own_default_from_a_factory():
    _, quick = _both(BODY)
    one, two = quick(1), quick(1)
    assert one.d == [] and one.d is not two.d


def test_arguments_are_checked_as_the_dataclass_checks_them():
    plain, quick = _both(BODY)
    for cls in (plain, quick):
        with pytest.raises(TypeError, match="missing 1 required positional argument: 'a'"):
            cls()
        with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
            cls(1, z=2)
        with pytest.raises(TypeError, match="positional arguments"):
            cls(1, "y", (), [], 5)  # e is keyword-only


def test_a_class_frozen_cannot_build_is_refused():
    with pytest.raises(TypeError, match="__post_init__"):
        frozen(type("Checked", (), {"__annotations__": {"a": "int"}, "__post_init__": lambda self: None}))
    with pytest.raises(TypeError, match="__init__"):
        frozen(type("Derived", (), {"__annotations__": {"a": "int"}, "a": field(init=False, default=0)}))
    with pytest.raises(TypeError, match="__post_init__"):  # slots: no instance dictionary to write
        frozen(slots=True)(type("Slotted", (), {"__annotations__": {"a": "int"}}))


def test_the_value_classes_cross_pickle_as_they_were():
    """What a shard's results and Ray's tasks pickle: a request with its patch (its key, a cached
    property, kept in the instance dictionary) and a cell."""
    from patchgrid.plan import Patch, Request, Start
    from patchgrid.sweeps.base import Cell

    patch = Patch("resid", 2, "0:clean", (3,))
    assert patch.key == "resid.2"
    req = Request(tokens=(1, 2, 3), answers=(4, 5), patches=(patch,), start=Start(2, "0:corrupt"))
    back = pickle.loads(pickle.dumps(req))
    assert back == req and back.patches[0].key == "resid.2" and hash(back) == hash(req)
    cell = Cell("resid", "resid", "denoise", 2, 3)
    assert pickle.loads(pickle.dumps(cell)) == cell


def test_the_hot_value_classes_are_made_by_it():
    """The classes a grid makes per run (what frozen() is for) go through it."""
    from patchgrid.metrics import Reading
    from patchgrid.plan import Forward, Patch, Request, Start
    from patchgrid.sweeps.base import Cell

    for cls in (Cell, Patch, Request, Start, Forward, Reading):
        assert cls.__init__.__code__.co_filename == "<string>" and "_pg_values" in cls.__init__.__code__.co_varnames
        assert cls.__dataclass_params__.frozen
