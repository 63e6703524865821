"""The strict record machinery every wire and on-host record is built on (`protocol` holds the contract).

`Record` is a dataclass with a strict wire form: `from_wire` refuses an unknown or missing field
(a `ProtocolError`, never a default), drops the fields an earlier version wrote (LEGACY), and reads
nested records through their own types (NESTED); `to_wire` writes plain JSON back. Kept apart from
the records themselves (`records`, `answers`) so that the contract's table (`protocol`) reads as a
table. Standard library only, Python 3.8 syntax: shipped to hosts with the rest of this package.
"""

from __future__ import annotations

from dataclasses import MISSING, fields


class ProtocolError(ValueError):
    """A record that does not fit its type: an unknown or missing field, kind, outcome or op."""


def _parse_enum(cls, value, what):
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ProtocolError("unknown %s %r (known: %s)" % (what, value, ", ".join(repr(m.value) for m in cls)))


class Record(object):
    """A dataclass with a strict wire form. NESTED: {field: Record class, or (list|dict, class)};
    RENAMED: {field: wire name} (a wire name that is a Python keyword); LEGACY: wire names an
    earlier version wrote, read and dropped; SPARSE: fields left off the wire while None (added since, so
    what an earlier version wrote and what this one writes for it stay the same)."""

    NESTED = {}
    SPARSE = ()
    RENAMED = {}
    LEGACY = ()

    @classmethod
    def from_wire(cls, data):
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ProtocolError("%s: expected an object, got %s" % (cls.__name__, type(data).__name__))
        by_wire, required = _shape(cls)
        unknown = sorted(k for k in data if k not in by_wire and k not in cls.LEGACY)
        if unknown:
            raise ProtocolError("%s: unknown field%s %s" % (cls.__name__, "s" if len(unknown) > 1 else "",
                                                            ", ".join(map(repr, unknown))))
        kw = {}
        for key, value in data.items():
            if key in by_wire:
                name = by_wire[key]
                kw[name] = _decode(cls.NESTED.get(name), value)
        missing = [n for n in required if n not in kw]
        if missing:
            raise ProtocolError("%s: missing field%s %s" % (cls.__name__, "s" if len(missing) > 1 else "",
                                                            ", ".join(map(repr, missing))))
        return cls(**kw)

    def to_wire(self):
        out = dict((wire, _encode(getattr(self, name))) for wire, name in _shape(type(self))[0].items())
        for name in self.SPARSE:
            if out.get(name) is None:
                out.pop(name, None)
        return out


_SHAPES = {}


def _shape(cls):
    """({wire name: field name} in field order, [required field names]) of a Record class, worked out once:
    `fields()` builds its tuple anew on every call, and every event and answer goes through here."""
    shape = _SHAPES.get(cls)
    if shape is None:
        spec = fields(cls)
        shape = _SHAPES[cls] = (dict((cls.RENAMED.get(f.name, f.name), f.name) for f in spec),
                                [f.name for f in spec if f.default is MISSING and f.default_factory is MISSING])
    return shape


def _decode(kind, value):
    if kind is None or value is None:
        return value
    if isinstance(kind, tuple):
        container, cls = kind
        if container is list:
            return [cls.from_wire(x) for x in value]
        return dict((k, cls.from_wire(x)) for k, x in value.items())
    return kind.from_wire(value)


def _encode(value):
    if isinstance(value, Record):
        return value.to_wire()
    if isinstance(value, list):
        return [_encode(x) for x in value]
    if isinstance(value, dict):
        return dict((k, _encode(x)) for k, x in value.items())
    return value


def wire_form(value):
    """A record (or a list or dict of them) as its wire form; None and plain values as they are."""
    return _encode(value)
