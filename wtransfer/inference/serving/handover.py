"""Prefill/decode disaggregation: a prompt's KV computed on a prefill instance, handed over to a
decode instance over a wtransfer backend, and decoded there only under the same weights.

The hand-over is an ordinary update of the weight-transfer machinery (packed buckets,
deadlines, a manifest checked before any byte lands, no pickle): the prefill instance is the
sender (`KVHandover`, one sender per decode instance, kept), its source one request's KV
(`KVSource`: ``kv/<request>/<layer>.k`` and ``.v``, [prompt tokens, KV heads, head dim] in the
cache's dtype), labelled with the weight version it was computed under; the decode instance's
receiver writes into a `KVTarget`, served under ``/kv/...`` beside its HTTP API (so its API key
guards it), which holds each request's KV until the engine takes it.

The decode instance decodes on received KV only when its version equals the engine's live one
(`Replica.add_prefilled`); otherwise, or when the prefill instance fails or dies mid-hand-over,
it prefills locally, and the choice says which (`prefilled_by`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta, dtype_name
from wtransfer.receiver.target import WeightTarget
from wtransfer.trainer.source import WeightSource

KV_NAME = re.compile(r"kv/(?P<request>[A-Za-z0-9_.:-]{1,128})/(?P<layer>\d{1,4})\.(?P<kind>[kv])")
"""What a KV tensor of a hand-over is called."""


def kv_name(request_id: str, layer: int, kind: str) -> str:
    """The hand-over name of `request_id`'s K ("k") or V ("v") of `layer`."""
    return f"kv/{request_id}/{layer}.{kind}"


@dataclass(frozen=True)
class KVShape:
    """What one request's KV looks like on an engine: layers, KV heads, head size, dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_tokens: int
    """The longest prompt whose KV is taken (the model length)."""


class KVSource(WeightSource):
    """One request's captured KV as a sender's source (see the module docstring)."""

    def __init__(self, request_id: str, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._items = [(kv_name(request_id, layer, kind), tensor)
                       for layer, pair in enumerate(kv) for kind, tensor in zip("kv", pair,
                                                                               strict=True)]

    def metadata(self) -> list[TensorMeta]:
        """Every layer's K and V."""
        return [TensorMeta.of(name, tensor) for name, tensor in self._items]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every layer's K and V, in order."""
        yield from self._items

    @property
    def device(self) -> torch.device | None:
        """Where the captured KV lives."""
        return self._items[0][1].device if self._items else None

    @property
    def delta_ok(self) -> bool:
        """False: each hand-over is a different request's KV."""
        return False


class KVTarget(WeightTarget):
    """Where handed-over KV lands on a decode instance: checked against the engine's KV
    shape before any byte lands, then kept per request until `take`."""

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self._arriving: dict[str, list[list[torch.Tensor | None]]] = {}
        self._ready: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.bytes_received = 0
        """KV bytes handed over so far (a counter for /metrics)."""

    @property
    def takes_deltas(self) -> bool:
        """False: every hand-over is whole."""
        return False

    @property
    def stages(self) -> bool:
        """True: hand-overs land in buffers of their own."""
        return True

    def metadata(self) -> list[TensorMeta]:
        """None ahead: each hand-over names its request's tensors (`check`)."""
        return []

    def held(self, name: str) -> TensorMeta | None:
        """None: nothing is held under a hand-over's names."""
        return None

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Every tensor a K or V of some request's layer, of the engine's KV shape and
        dtype, every layer's K and V present, at most the model length of tokens."""
        shape, problems = self.shape, []
        seen: dict[str, set[tuple[int, str]]] = {}
        for meta in metas:
            found = KV_NAME.fullmatch(meta.name)
            if found is None:
                problems.append(f"{meta.name!r} is not kv/<request>/<layer>.k|v")
                continue
            layer = int(found["layer"])
            tokens = meta.shape[0] if meta.shape else 0
            if layer >= shape.layers:
                problems.append(f"{meta.name!r}: the model has {shape.layers} layers")
            elif meta.dtype != shape.dtype or len(meta.shape) != 3 or \
                    tuple(meta.shape[1:]) != (shape.kv_heads, shape.head_dim) or \
                    not 1 <= tokens <= shape.max_tokens:
                problems.append(f"{meta.name!r}: {meta.dtype}{list(meta.shape)}, expected "
                                f"{shape.dtype}[1..{shape.max_tokens}, {shape.kv_heads}, "
                                f"{shape.head_dim}]")
            seen.setdefault(found["request"], set()).add((layer, found["kind"]))
        for request, parts in seen.items():
            if len(parts) != 2 * shape.layers:
                problems.append(f"request {request!r}: {len(parts)} of the "
                                f"{2 * shape.layers} K/V tensors")
        if problems:
            raise MetadataError("KV hand-over refused: " + "; ".join(problems[:5]))
        with self._lock:
            for request in seen:
                self._arriving[request] = [[None, None] for _ in range(shape.layers)]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep a copy of each tensor (they are views of staging memory)."""
        with self._lock:
            for name, tensor in weights:
                found = KV_NAME.fullmatch(name)
                assert found is not None  # checked
                slot = self._arriving[found["request"]][int(found["layer"])]
                slot["kv".index(found["kind"])] = tensor.clone()
                self.bytes_received += tensor.numel() * tensor.element_size()

    def finish(self) -> None:
        """The hand-over is complete: its requests' KV can be taken."""
        with self._lock:
            for request, layers in self._arriving.items():
                pairs = [(k, v) for k, v in layers if k is not None and v is not None]
                if len(pairs) == len(layers):
                    self._ready[request] = pairs
            self._arriving = {}

    def abort(self) -> None:
        """A hand-over failed: what it brought is dropped."""
        with self._lock:
            self._arriving = {}

    def take(self, request_id: str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The KV handed over for `request_id` (once), or None."""
        with self._lock:
            return self._ready.pop(request_id, None)

    def fingerprint(self) -> dict[str, str]:
        """Nothing: a KV target holds no weights."""
        return {}


def kv_shape(runner: Any, max_tokens: int) -> KVShape:
    """The KV shape of a model runner's cache."""
    k, _ = runner.kv[0]
    return KVShape(layers=len(runner.kv), kv_heads=int(k.shape[1]), head_dim=int(k.shape[2]),
                   dtype=dtype_name(k.dtype), max_tokens=max_tokens)


KV_BUCKET_BYTES = 4 << 20
"""Staging bucket of a KV hand-over (a prompt's K/V is megabytes, not gigabytes)."""


class KVHandover:
    """A prefill instance's senders of handed-over K/V: one per decode instance and backend,
    kept across requests (one hand-over at a time on each)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._senders: dict[tuple[str, str], Any] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()
        self.bytes_sent = 0
        """K/V bytes handed over so far (a counter for /metrics)."""

    def send(self, url: str, api_key: str | None, backend: str, init_fields: dict[str, Any],
             request_id: str, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
             version: str) -> int:
        """Hand `request_id`'s K/V over to the decode instance whose hand-over routes are at
        `url` (its ``/kv``), labelled `version`; the bytes moved. A failed hand-over drops that
        instance's sender (the next one connects again)."""
        from wtransfer.control.clients import HTTPClient
        from wtransfer.registry import get_backend, trainer_init
        from wtransfer.wire import parse_record

        key = (url, backend)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            sender = self._senders.get(key)
            source = KVSource(request_id, kv)
            if sender is None:
                info = get_backend(backend).sender_class().init_info_cls
                fields: Any = parse_record(info, {"bucket_bytes": KV_BUCKET_BYTES,
                                             "timeout_s": self.timeout_s, **init_fields},
                                      where="KV hand-over init_fields")
                sender = trainer_init(fields, client=HTTPClient(url, api_key=api_key,
                                                                timeout_s=self.timeout_s),
                                      source=source)
                self._senders[key] = sender
            sender.source = source
            try:
                stats = sender.send_weights(weight_version=version)
            except BaseException:
                self._senders.pop(key, None)
                sender.shutdown()
                raise
            self.bytes_sent += stats.bytes
            return int(stats.bytes)

    def close(self) -> None:
        """Shut every sender down."""
        for sender in self._senders.values():
            sender.shutdown()
        self._senders = {}
