"""LoRA adapters on a running model, many in one batch.

The base weights are loaded once; adapters (`mlx_lm.lora` output folders) are loaded on a
row's first use into a bounded resident set (LRU, bounded by their bytes where a byte budget
is given, else by count; an adapter a running row uses never leaves). Each linear layer an
adapter targets is wrapped once by a `MultiLoRALinear`: the base product runs once for the
whole batch, and every row adds its own adapter's low-rank product `scale * (x @ A) @ B`
through one gather_mm over the resident adapters' stacked weights
(worker/model/adapters/stacks.py; rows without an adapter get exactly the base output). That
is the arithmetic of mlx-lm's LoRALinear per row, so a row's greedy output equals
`mlx_lm.load(base, adapter_path=...)` generating alone. The experts of an MoE block get the
same per row (worker/model/adapters/experts.py).

Which rows a forward runs is set by the batch generator around each forward
(`VectorBatchGenerator.route_rows` -> `AdapterBank.rows`), prefill and decode (speculative
verification included, which runs inside the decode step).

An adapter's `tag` is part of its rows' cache scope (worker/model/cache/scopes.py), so a prefix
computed under one adapter is never served to another adapter or to the base."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ....shared.errors import invalid
from .experts import MultiLoRASwitchLinear, expert_dims, fits, route_block
from .formats import non_finite, read_pairs, weights_file
from .stacks import GroupKey, LoraTable, MultiLoRALinear, RowRouting, group_key

log = logging.getLogger(__name__)

NO_ADAPTER = -1
# Request ids whose adapter is remembered from preparation to admission (and re-admission
# after a pause); the oldest are forgotten past this.
MAX_NOTED_REQUESTS = 65536


def linear_dims(layer: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a plain or quantized linear layer; None for other kinds."""
    if isinstance(layer, nn.QuantizedLinear):
        out, packed = layer.weight.shape
        return packed * 32 // layer.bits, out
    if isinstance(layer, nn.Linear):
        out, inp = layer.weight.shape
        return inp, out
    return None


def refused(name: str, why: str):
    return invalid(f"the adapter '{name}' cannot be served: {why}", "model")


def read_adapter(name: str, folder: Path, modules: dict[str, nn.Module]) -> tuple[float, dict[str, tuple]]:
    """An adapter folder's scale and its (lora_a, lora_b) per layer path (mlx_lm.lora's or
    PEFT's layout: worker/model/adapters/formats.py), checked against the model's layers; a 400 saying
    what is wrong for a folder that is not one, a fine-tune that is not LoRA, or weights that
    do not fit this model."""
    try:
        scale, pairs = read_pairs(folder)
    except ValueError as e:
        raise refused(name, str(e)) from None
    layers = {}
    for path, pair in pairs.items():
        module = modules.get(path)
        base = module.base if isinstance(module, (MultiLoRALinear, MultiLoRASwitchLinear)) else module
        a, b = pair.get("lora_a"), pair.get("lora_b")
        if a is None or b is None:
            raise refused(name, f"{path}: lora_a and lora_b do not form a low-rank pair")
        if base is not None and (experts := expert_dims(base)) is not None:  # an MoE block's experts
            if not fits(a, b, experts):
                raise refused(name, f"{path}: shapes {tuple(a.shape)} x {tuple(b.shape)} do not fit its experts")
            layers[path] = (a, b)
            continue
        dims = linear_dims(base) if base is not None else None
        if dims is None:
            what = "no such layer" if base is None else f"a {type(base).__name__}, not a linear layer"
            raise refused(name, f"{path} is {what} in this model (trained for another model?)")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise refused(name, f"{path}: lora_a and lora_b do not form a low-rank pair")
        if a.shape[0] != dims[0] or b.shape[1] != dims[1]:
            raise refused(
                name, f"{path}: shapes {tuple(a.shape)} x {tuple(b.shape)} do not fit a {dims[0]} -> {dims[1]} layer"
            )
        layers[path] = (a, b)
    problem = non_finite(scale, layers, {path: activation_dtype(modules[path]) for path in layers})
    if problem is not None:  # it would end its own rows in NaN (other rows never use it)
        raise refused(name, problem)
    return scale, layers


def activation_dtype(module: nn.Module) -> mx.Dtype:
    """The dtype a layer's input runs in: its weights', or a quantized layer's scales'."""
    base = module.base if isinstance(module, (MultiLoRALinear, MultiLoRASwitchLinear)) else module
    return (getattr(base, "scales", None) if hasattr(base, "scales") else base.weight).dtype


@dataclass
class LoadedAdapter:
    name: str
    path: str
    slot: int
    scale: float
    layers: dict[str, GroupKey]  # layer path -> its stack group
    positions: dict[GroupKey, int]  # its position in each group's stacks
    nbytes: int
    tag: int  # its part of its rows' cache scope (worker/model/cache/scopes.py)
    users: set[int] = field(default_factory=set)  # uids of the rows that use it


def cache_tag(name: str, weights: Path) -> int:
    """An adapter's part of its rows' cache scope: another name, or the same name with other
    weights (rewritten in place), gets another one."""
    st = weights.stat()
    digest = hashlib.blake2b(f"{name}\0{weights.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode(), digest_size=8)
    return 1 + int.from_bytes(digest.digest(), "little") % (2**31 - 1)


class AdapterSet(NamedTuple):
    """An entry's adapters (models.yaml adapters, resident_adapters, adapter_memory_mb): name ->
    mlx_lm.lora folder, how many stay loaded, and their weights' bound in bytes (None: by count)."""

    sources: dict[str, str] = {}
    max_resident: int = 8
    max_bytes: int | None = None


class AdapterBank:
    """The adapters a worker may serve (name -> folder) and those resident now."""

    def __init__(
        self,
        model: nn.Module,
        sources: dict[str, str] | None = None,
        max_resident: int = 8,
        max_bytes: int | None = None,
    ):
        """max_bytes: the resident adapters' weights bound (bytes); None: max_resident bounds
        their count instead. Either way, adapters running rows use stay."""
        self.model = model
        self.sources: dict[str, str] = dict(sources or {})
        self.max_resident = max(1, max_resident)
        self.max_bytes = max_bytes
        self.routing = RowRouting()
        self.resident: OrderedDict[str, LoadedAdapter] = OrderedDict()  # least recently used first
        self.by_uid: dict[int, LoadedAdapter] = {}
        self._noted: OrderedDict[str, str] = OrderedDict()  # request id -> adapter name
        self._wrapped: dict[str, MultiLoRALinear | MultiLoRASwitchLinear] = {}
        self._slots: set[int] = set()  # the resident adapters' slots (a freed one is reused)
        self._positions: dict[GroupKey, list[int | None]] = {}  # group -> the slot at each position
        self.loads = 0
        self.evictions = 0
        self._bytes = 0  # the resident adapters' weights, read off the engine thread too (an int)

    # -- requests -----------------------------------------------------------------------------
    def note(self, rid: str, adapter: str | None, prompt_logprobs: int | None = None) -> None:
        """At preparation (off the engine thread): refuse an unknown adapter, remember a known
        one for the request's admission."""
        if adapter is None:
            return
        if adapter not in self.sources:
            raise invalid(f"the adapter '{adapter}' is not configured on this model", "model")
        if prompt_logprobs is not None:
            raise invalid("prompt logprobs (echo with logprobs) are not served with an adapter", "logprobs")
        self._noted[rid] = adapter
        self._noted.move_to_end(rid)
        while len(self._noted) > MAX_NOTED_REQUESTS:
            self._noted.popitem(last=False)

    def for_row(self, name: str | None, guard: object = None) -> LoadedAdapter | None:
        """A new row's adapter: the one named, else the one its request named at preparation
        (found by the request id its guard carries); loaded now if it is not resident."""
        name = name or self._noted.get(getattr(guard, "rid", None) or "")
        return self.acquire(name) if name is not None else None

    def acquire(self, name: str) -> LoadedAdapter:
        """The adapter, loaded now if it is not resident (engine thread, at admission)."""
        adapter = self.resident.get(name)
        if adapter is None:
            adapter = self._load(name)
        self.resident.move_to_end(name)
        return adapter

    def bind(self, uid: int, adapter: LoadedAdapter | None) -> None:
        if adapter is None:
            return
        adapter.users.add(uid)
        self.by_uid[uid] = adapter
        self._evict()

    def release(self, uid: int) -> None:
        adapter = self.by_uid.pop(uid, None)
        if adapter is None:
            return
        adapter.users.discard(uid)
        if not adapter.users and self.sources.get(adapter.name) != adapter.path:  # removed or replaced meanwhile
            self._unload(adapter)
        elif not adapter.users:
            # A burst may have held more than the bound (rows in use never leave): back within
            # it as soon as they end, not at the next load.
            self._evict()

    def name_of(self, uid: int) -> str | None:
        adapter = self.by_uid.get(uid)
        return adapter.name if adapter is not None else None

    @contextmanager
    def rows(self, uids: list[int]) -> Iterator[None]:
        """The forward built inside runs these rows (batch order): route each to its adapter."""
        slots = [self.by_uid[u].slot if u in self.by_uid else NO_ADAPTER for u in uids] if self.by_uid else []
        active = tuple(sorted({s for s in slots if s != NO_ADAPTER}))
        if not active:
            yield
            return
        adapters = [self.by_uid.get(u) for u in uids]
        keys = {k for a in adapters if a is not None for k in a.positions}
        # Rows outside a group (the base's, another group's) stay out of its product altogether.
        groups = {
            key: [(a.positions[key], a.scale) if a is not None and key in a.positions else None for a in adapters]
            for key in keys
        }
        self.routing.set(slots, active, groups)
        try:
            yield
        finally:
            self.routing.clear()

    # -- the registry -------------------------------------------------------------------------
    def set_sources(self, sources: dict[str, str], check: str | None = None) -> dict:
        """A new list of servable adapters (hot add and remove): adapters no longer listed, or
        listed with another folder, leave once no running row uses them. check: an adapter
        to load now; when it cannot be, the list stays as it was and the error is raised."""
        previous, self.sources = self.sources, dict(sources)
        if check is not None:
            try:
                self.acquire(check)
            except Exception:
                self.sources = previous
                raise
        for adapter in list(self.resident.values()):
            if not adapter.users and self.sources.get(adapter.name) != adapter.path:
                self._unload(adapter)
        self._evict()
        return self.stats()

    def _load(self, name: str) -> LoadedAdapter:
        path = self.sources.get(name)
        if path is None:
            raise invalid(f"the adapter '{name}' is not configured on this model", "model")
        folder = Path(path)
        modules = dict(self.model.named_modules())
        scale, layers = read_adapter(name, folder, modules)
        nbytes = sum(w.nbytes for pair in layers.values() for w in pair)
        if self.max_bytes is not None and nbytes > self.max_bytes:  # it could never be resident
            raise refused(
                name,
                f"its weights ({nbytes / 2**20:.2f} MB) exceed adapter_memory_mb ({self.max_bytes / 2**20:.2f} MB)",
            )
        self._evict(incoming=nbytes)
        mx.eval([w for pair in layers.values() for w in pair])
        slot = min(set(range(len(self._slots) + 1)) - self._slots)
        try:
            wrapped = [self._wrap(layer_path, modules) for layer_path in layers]
        except TypeError as e:  # an MoE block kind whose experts are not served
            raise refused(name, str(e)) from None
        self._slots.add(slot)
        targets: dict[GroupKey, list[tuple[MultiLoRALinear | MultiLoRASwitchLinear, tuple]]] = {}
        kinds: dict[str, GroupKey] = {}
        for layer_path, wrapper, (a, b) in zip(layers, wrapped, layers.values()):
            key = kinds[layer_path] = group_key(a, b)
            targets.setdefault(key, []).append((wrapper, (a, b)))
        positions, fresh = {}, []
        for key, group in targets.items():
            book = self._positions.setdefault(key, [])
            pos = book.index(None) if None in book else len(book)
            grown = pos == len(book)
            book[pos : pos + 1] = [slot]
            positions[key] = pos
            puts = {id(w): (w, {pos: pair}) for w, pair in group}
            for w in self._stacked_wrappers(key) if grown else ():  # the group's other layers: a zero position
                puts.setdefault(id(w), (w, {}))
            for w, put in puts.values():
                fresh += w.table.restack(key, len(book), put)
        mx.eval(fresh)  # copies into the stacks; the adapter's own arrays are dropped
        tag = cache_tag(name, weights_file(folder))
        adapter = LoadedAdapter(name, path, slot, scale, kinds, positions, nbytes, tag)
        self.resident[name] = adapter
        self._bytes += nbytes
        self.loads += 1
        log.info("adapter %s loaded: %d layers, %.1f MB", name, len(layers), nbytes / 2**20)
        return adapter

    def _stacked_wrappers(self, key: GroupKey) -> list[MultiLoRALinear | MultiLoRASwitchLinear]:
        return [w for w in self._wrapped.values() if key in w.table.stacks]

    def _wrap(self, path: str, modules: dict[str, nn.Module]) -> MultiLoRALinear | MultiLoRASwitchLinear:
        module = modules[path]
        if isinstance(module, (MultiLoRALinear, MultiLoRASwitchLinear)):
            return module
        if expert_dims(module) is not None:
            route_block(modules[path.rpartition(".")[0]], self.routing)  # TypeError: a block kind not served
            wrapper = MultiLoRASwitchLinear(module, self.routing, LoraTable())
        else:
            wrapper = MultiLoRALinear(module, self.routing, LoraTable())
        self.model.update_modules(tree_unflatten([(path, wrapper)]))  # as mlx-lm places its LoRA layers
        self._wrapped[path] = modules[path] = wrapper
        return wrapper

    def _unload(self, adapter: LoadedAdapter) -> None:
        fresh = []
        for layer_path, key in adapter.layers.items():
            table = self._wrapped[layer_path].table
            fresh += table.restack(key, len(self._positions[key]), {adapter.positions[key]: None})
        for key, pos in adapter.positions.items():
            book = self._positions[key]
            book[pos] = None
            if book[-1] is None:  # trailing free positions leave every stack of the group
                while book and book[-1] is None:
                    book.pop()
                for w in self._stacked_wrappers(key):
                    fresh += w.table.restack(key, len(book), {})
            if not book:
                del self._positions[key]
        mx.eval(fresh)
        self._slots.discard(adapter.slot)
        if self.resident.pop(adapter.name, None) is not None:
            self._bytes -= adapter.nbytes
        log.info("adapter %s unloaded", adapter.name)

    def resident_bytes(self) -> int:
        return self._bytes

    def _evict(self, incoming: int | None = None) -> None:
        """Unload idle adapters, least recently used first, until the resident set (plus an
        adapter of `incoming` bytes about to load) is within the byte bound, else the count."""

        def over() -> bool:
            if self.max_bytes is not None:
                return self.resident_bytes() + (incoming or 0) > self.max_bytes
            return len(self.resident) + (incoming is not None) > self.max_resident

        for adapter in list(self.resident.values()):
            if not over():
                return
            if not adapter.users:
                self._unload(adapter)
                self.evictions += 1

    def stats(self) -> dict:
        return {
            "configured": sorted(self.sources),
            "resident": list(self.resident),
            "resident_bytes": self.resident_bytes(),
            "max_resident": self.max_resident,
            "max_bytes": self.max_bytes,
            "loads": self.loads,
            "evictions": self.evictions,
            "rows": len(self.by_uid),
        }
