"""The namespace: an unambiguous, versioned encoding, derived by the configuration from the page layout.

Two caches share pages exactly when their effective namespaces are equal; these tests pin what goes into
one (every field that changes the bytes of a page, the model identity, the tensor-parallel rank and size)
and that no two different field sets encode alike.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache import HiCache, HiCacheConfig, KVLayout, MambaState, Namespace, SlidingWindow
from hicache.config import layout_signature
from hicache.keys import NAMESPACE_ENCODING_VERSION, chained_page_hashes
from hicache.layout import PAGE_FIRST_LAYOUT_VERSION

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, page_size=4)


def config(**overrides: object) -> HiCacheConfig:
    options: dict[str, object] = {
        "layout": LAYOUT,
        "device_pages": 8,
        "host_pages": 8,
        "namespace": Namespace(model_id="model@rev1"),
    }
    options.update(overrides)
    return HiCacheConfig(**options)  # type: ignore[arg-type]


def with_layout(**fields: object) -> KVLayout:
    return dataclasses.replace(LAYOUT, **fields)  # type: ignore[arg-type]


def test_separator_in_a_field_cannot_shift_into_the_next() -> None:
    """The old digest joined fields with an unescaped 0x1f: ("a\\x1fb", "c") and ("a", "b\\x1fc") collided."""
    one = Namespace(model_id="a\x1fb", extra="c")
    two = Namespace(model_id="a", extra="b\x1fc")
    assert one.encoding != two.encoding
    assert one.digest != two.digest
    # The same shift across the other string fields.
    assert Namespace(extra="a\x1fb", layout="c").digest != Namespace(extra="a", layout="b\x1fc").digest
    assert Namespace(model_id='a","extra":"b').digest != Namespace(model_id="a", extra="b").digest


def test_encoding_is_canonical_json_with_a_version() -> None:
    """The encoding is sorted, compact, ASCII-only JSON carrying the encoding version."""
    ns = Namespace(model_id="llama-3-8b@abc123", tp_rank=1, tp_size=2, extra="run-7", layout="{}")
    assert json.loads(ns.encoding) == {
        "v": NAMESPACE_ENCODING_VERSION,
        "model_id": "llama-3-8b@abc123",
        "tp_rank": 1,
        "tp_size": 2,
        "extra": "run-7",
        "layout": "{}",
    }
    assert ns.encoding == (
        b'{"extra":"run-7","layout":"{}","model_id":"llama-3-8b@abc123","tp_rank":1,"tp_size":2,"v":2}'
    )
    assert Namespace(model_id="\u00e9\x00").encoding.isascii()


def test_digest_is_pinned() -> None:
    """The digest names pages in shared storage across processes and releases: it must not drift (a change
    of encoding must bump `NAMESPACE_ENCODING_VERSION` and this value together)."""
    digest = Namespace(model_id="pinned", tp_rank=0, tp_size=1, extra="", layout="").digest
    assert digest == Namespace(model_id="pinned").digest
    assert digest.hex() == "84295c81c4ec131b498c3f7b075d034b"


field_tuples = st.tuples(
    st.text(max_size=6),
    st.integers(0, 3),
    st.integers(1, 4),
    st.text(max_size=6),
    st.text(max_size=6),
).filter(lambda t: t[1] < t[2])


@given(field_tuples, field_tuples)
def test_distinct_fields_give_distinct_encodings(
    a: tuple[str, int, int, str, str], b: tuple[str, int, int, str, str]
) -> None:
    """Distinct field tuples never share an encoding: the encoding decodes back to its fields."""
    na = Namespace(model_id=a[0], tp_rank=a[1], tp_size=a[2], extra=a[3], layout=a[4])
    nb = Namespace(model_id=b[0], tp_rank=b[1], tp_size=b[2], extra=b[3], layout=b[4])
    decoded = json.loads(na.encoding)
    assert (
        decoded["model_id"],
        decoded["tp_rank"],
        decoded["tp_size"],
        decoded["extra"],
        decoded["layout"],
    ) == a
    assert (na.encoding == nb.encoding) == (a == b)
    assert (na == nb) == (a == b)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"model_id": 3}, TypeError, "model_id"),
        ({"extra": None}, TypeError, "extra"),
        ({"layout": b"x"}, TypeError, "layout"),
        ({"tp_rank": True}, TypeError, "tp_rank"),
        ({"tp_size": 1.0}, TypeError, "tp_size"),
        ({"tp_size": 0}, ValueError, "tp_size"),
        ({"tp_rank": -1}, ValueError, "tp_rank"),
        ({"tp_rank": 2, "tp_size": 2}, ValueError, "tp_rank"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(
    fields: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Namespace(**fields)  # type: ignore[arg-type]


VARIANTS: dict[str, HiCacheConfig] = {
    "base": config(),
    "num_layers": config(layout=with_layout(num_layers=4)),
    "heads_and_dim_same_bytes": config(layout=with_layout(num_kv_heads=4, head_dim=8)),
    "head_dim": config(layout=with_layout(head_dim=32)),
    "dtype_same_bytes": config(layout=with_layout(dtype=torch.bfloat16)),
    "dtype": config(layout=with_layout(dtype=torch.float32)),
    "page_size": config(layout=with_layout(page_size=8)),
    "model_id": config(namespace=Namespace(model_id="model@rev2")),
    "no_model_id": config(namespace=Namespace()),
    "tp_rank": config(namespace=Namespace(model_id="model@rev1", tp_rank=1, tp_size=2)),
    "tp_size": config(namespace=Namespace(model_id="model@rev1", tp_rank=0, tp_size=2)),
    "extra": config(namespace=Namespace(model_id="model@rev1", extra="int8-kv")),
    "swa": config(components=(SlidingWindow(8, KVLayout.flat(8, 4), device_pages=4, host_pages=4),)),
    "swa_layout": config(components=(SlidingWindow(8, KVLayout.flat(16, 4), device_pages=4, host_pages=4),)),
    "swa_name": config(
        components=(SlidingWindow(8, KVLayout.flat(8, 4), device_pages=4, host_pages=4, name="window"),)
    ),
    "mamba": config(components=(MambaState(16, device_slots=2, host_slots=2),)),
    "mamba_state": config(components=(MambaState(32, device_slots=2, host_slots=2),)),
}


def test_every_field_that_changes_page_bytes_changes_the_namespace() -> None:
    """Configurations differing in any layout, component, identity or TP field never share a digest,
    and so never a page key."""
    digests = {name: cfg.namespace.digest for name, cfg in VARIANTS.items()}
    assert len(set(digests.values())) == len(digests), digests
    key = torch.arange(8).numpy().tobytes()
    first_keys = {chained_page_hashes(key, 4, cfg.namespace)[0] for cfg in VARIANTS.values()}
    assert len(first_keys) == len(VARIANTS)


def test_same_configuration_gives_the_same_namespace() -> None:
    """Two processes configured alike derive the same namespace (and share pages)."""
    again = config()
    assert again.namespace == VARIANTS["base"].namespace
    assert again.namespace.digest == VARIANTS["base"].namespace.digest
    # Things that do not change page bytes leave it alone: pool sizes, policies, a sliding window's length.
    assert config(device_pages=99, host_pages=3).namespace == again.namespace
    swa = VARIANTS["swa"].namespace
    longer = config(components=(SlidingWindow(16, KVLayout.flat(8, 4), device_pages=4, host_pages=4),))
    assert longer.namespace == swa


def test_the_layout_is_derived_and_cannot_be_forged() -> None:
    """A caller-provided `layout` is replaced: no caller makes two different layouts share a namespace."""
    base = VARIANTS["base"]
    assert base.namespace.layout == layout_signature(LAYOUT)
    forged = config(
        layout=with_layout(dtype=torch.bfloat16),
        namespace=dataclasses.replace(base.namespace),  # carries the float16 layout's signature
    )
    assert forged.namespace.layout == layout_signature(with_layout(dtype=torch.bfloat16))
    assert forged.namespace.digest != base.namespace.digest
    moved = dataclasses.replace(base, layout=with_layout(num_layers=3))
    assert moved.namespace.layout == layout_signature(with_layout(num_layers=3))
    assert moved.namespace.model_id == "model@rev1"


def test_layout_signature_names_every_byte_deciding_field() -> None:
    signature = json.loads(layout_signature(LAYOUT, VARIANTS["mamba"].components))
    assert signature["kv"] == {
        "num_layers": 2,
        "planes": 2,
        "page_size": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "dtype": "float16",
        "page_first": PAGE_FIRST_LAYOUT_VERSION,
    }
    [mamba] = signature["components"]
    assert (mamba["name"], mamba["kind"]) == ("mamba", "MambaState")
    assert mamba["pool"] == VARIANTS["mamba"].components[0].pool_layout(4).signature()


async def test_storage_without_a_model_id_warns_once_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a storage tier and no model identity, start() logs exactly one warning; otherwise none."""
    url = f"file://{tmp_path}"

    def warnings() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "model_id" in r.message
        ]

    with caplog.at_level(logging.WARNING, logger="hicache"):
        async with HiCache(config(namespace=Namespace(), storage_url=url)) as cache:
            await cache.start()  # a second start is a no-op: still one warning
        assert len(warnings()) == 1
        caplog.clear()
        async with HiCache(config(storage_url=url)):
            pass
        async with HiCache(config(namespace=Namespace())):
            pass
        assert warnings() == []
