"""Plain dataclasses of settings filled from config mappings, refusing keys they do not know."""

from dataclasses import fields


def from_mapping(cls, mapping, what: str):
    """cls(**mapping), or a ValueError that lists the unknown keys of ``what`` and the known ones."""
    mapping = dict(mapping or {})
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {known}")
    return cls(**mapping)
