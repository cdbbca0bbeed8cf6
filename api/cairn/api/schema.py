"""Schema helpers shared by the spec models (CEL rules, defaults, patterns).

Pure. The ``x-kubernetes-*`` extras set here travel through pydantic's JSON
schema into the CRD (``cairn.api.crdgen``). Patterns avoid backslashes: CEL
string literals reject escapes such as ``\\s``.
"""

import re
from typing import Annotated, Any

import pydantic
from pydantic import alias_generators

S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^ ]*)?$"
ENDPOINT_PATTERN = r"^https?://[^ /]+(/[^ ]*)?$"
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
ABS_PATH_PATTERN = r"^/[^ ]*$"
SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

Quantity = int | Annotated[str, pydantic.Field(max_length=64)]
"""A core/v1 quantity: the CRD says x-kubernetes-int-or-string."""

QUANTITY_PATTERN = r"^[+-]?([0-9]+([.][0-9]*)?|[.][0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
"""resource.Quantity's syntax (the API server's own parser in CEL: ``isQuantity``)."""


def quantity_rule(value: str) -> str:
    """CEL: the int-or-string ``value`` parses as a quantity and is not negative.
    ``quantity()``/``isQuantity`` are the Kubernetes CEL quantity library (1.29+)."""
    text = f"string({value})"
    return f"isQuantity({text}) && !quantity({text}).isLessThan(quantity('0'))"


def check_quantity(value: int | str, field: str) -> int | str:
    """Pure twin of :func:`quantity_rule`."""
    text = str(value)
    if re.fullmatch(QUANTITY_PATTERN[1:-1], text) is None or text.startswith("-"):
        raise ValueError(f"{field} must be a non-negative quantity such as 500m, 2 or 4Gi")
    return value


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """JSON-schema extra carrying CEL rules: (rule, message[, fieldPath])."""
    out: list[dict[str, str]] = []
    for item in rules:
        entry = {"rule": item[0], "message": item[1]}
        if len(item) == 3:
            entry["fieldPath"] = item[2]
        out.append(entry)
    return {"x-kubernetes-validations": out}


PRESERVE: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}
"""Schema extra for opaque Kubernetes sub-objects (affinity, volumes…)."""


def object_default(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """Schema extra: the model's full default, so the API server creates the
    object with every nested default (CEL rules see them) and kubectl explain
    shows them."""
    return {"default": model().model_dump(mode="json", by_alias=True, exclude_none=True)}


class SpecModel(pydantic.BaseModel):
    """Spec models: camelCase on the wire, unknown fields rejected, no coercion
    (the API server does not coerce either)."""

    model_config = pydantic.ConfigDict(
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        strict=True,
    )


def matches(pattern: str, value: str, field: str) -> str:
    if re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is None:
        raise ValueError(f"{field} must match {pattern}")
    return value
