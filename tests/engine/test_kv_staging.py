"""The KV handoff between the cache's device and host memory (engine/worker/kv_staging.py).

On a GPU an export packs with the Triton kernel, copies to pinned staging memory on a side
stream and is waited for off the engine thread; an import copies to the device and unpacks
with the kernel. Without a GPU the kernels run in Triton's interpreter (tests/conftest.py)
when forced (`use_kernels=True`): they must give exactly the bytes and caches of the CPU's
torch path, the staging area must be reused and never fail a payload, and a forced-kernel
handoff between two engines (and between the two workers) must give the same tokens.
The GPU-only test at the end is the CUDA twin of these.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.hashing import hash_block_chain
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.modeling import kv_quant
from pdserve.engine.worker.kv_staging import KVStaging
from pdserve.kernels.kv_pack import ref_kv_pack
from pdserve.kv_transfer.base import ReceiverConfig
from pdserve.kv_transfer.errors import UnknownRequestError
from pdserve.kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.kv_transfer.torch_payload import layout_of, payload_bytes
from pdserve.prefill_worker.worker import PrefillWorker

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
TOKEN = "cluster-token"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_cache(dtype: torch.dtype, device: str = "cpu", num_blocks: int = 12) -> torch.Tensor:
    """[layers, 2, blocks, kv_heads, block_size, head_dim] of random values (and a NaN:
    the handoff moves bits, not numbers). uint8: an 8-bit cache's rows
    (engine/modeling/kv_quant.py), 8 int8 codes and the 2 bytes of their bf16 scale."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, num_blocks, 2, BLOCK, 8, generator=gen)
    if dtype == torch.uint8:
        return kv_quant.quantize(cache, "int8").to(device)
    cache = cache.to(dtype)
    cache[1, 0, 3, 1, 2, 5] = float("nan")
    return cache.to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_kernels_move_the_same_bytes_as_the_torch_path(dtype: torch.dtype) -> None:
    cache = random_cache(dtype)
    ids = [7, 2, 9, 0, 3]
    kernels = KVStaging(cache, 1 << 16, use_kernels=True)
    torch_path = KVStaging(cache, 1 << 16)
    assert kernels.use_kernels and not torch_path.use_kernels and not torch_path.staged

    by_kernel, by_torch = kernels.export_blocks(ids), torch_path.export_blocks(ids)
    assert by_kernel.in_staging and not by_torch.in_staging  # CPU default: no staging
    assert by_kernel.ready() and by_torch.ready()
    packed = by_kernel.wait()
    assert packed.device.type == "cpu" and packed.is_contiguous()
    assert packed.shape == (2, 2, len(ids), 2, BLOCK, cache.shape[-1]) and packed.dtype == dtype
    assert same_bytes(packed, by_torch.wait())
    assert same_bytes(packed, ref_kv_pack(cache, torch.tensor(ids)))

    # import into fresh caches, each way, at other block ids: the same caches result
    dest = [11, 1, 4, 6, 8]
    caches = []
    for use_kernels in (True, False):
        target = torch.zeros_like(cache)
        KVStaging(target, 1 << 16, use_kernels=use_kernels).import_blocks(packed, dest)
        caches.append(target)
    assert same_bytes(caches[0], caches[1])
    for src, dst in zip(ids, dest, strict=True):
        assert same_bytes(caches[0][:, :, dst], cache[:, :, src])
    untouched = [b for b in range(cache.shape[2]) if b not in dest]
    assert not caches[0][:, :, untouched].any()


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
def test_bad_ids_and_payloads_are_refused(use_kernels: bool) -> None:
    cache = random_cache(torch.float32)
    staging = KVStaging(cache, 1 << 16, use_kernels=use_kernels)
    with pytest.raises(ValueError, match="must lie in"):
        staging.export_blocks([0, 12])
    with pytest.raises(ValueError, match="must lie in"):
        staging.export_blocks([-1])
    payload = staging.export_blocks([1, 2]).wait().clone()
    before = cache.clone()
    with pytest.raises(ValueError, match="repeat"):
        staging.import_blocks(payload, [5, 5])
    with pytest.raises(ValueError, match="must lie in"):
        staging.import_blocks(payload, [5, 12])
    with pytest.raises(ValueError, match="not 3 blocks"):
        staging.import_blocks(payload, [5, 6, 7])
    with pytest.raises(ValueError, match="not 2 blocks"):
        staging.import_blocks(payload.to(torch.bfloat16), [5, 6])
    assert same_bytes(cache, before)  # nothing written


def test_staging_regions_are_reused_and_never_fail_a_payload() -> None:
    cache = random_cache(torch.float32)
    block_bytes = 2 * 2 * 2 * BLOCK * 8 * 4  # all layers, K and V, of one block: 512
    staging = KVStaging(cache, 4 * block_bytes, use_kernels=True)  # room for 4 blocks
    arena = staging.arena
    assert arena.capacity == 4 * block_bytes

    first = staging.export_blocks([0, 1])
    second = staging.export_blocks([2, 3])
    assert first.in_staging and second.in_staging and arena.free_bytes == 0
    full = staging.export_blocks([4])  # the area is full: a one-off buffer, still right
    assert not full.in_staging and staging.num_one_off == 1
    assert same_bytes(full.wait(), ref_kv_pack(cache, torch.tensor([4])))

    first_ptr = first.wait().data_ptr()
    first.release()
    first.release()  # harmless
    with pytest.raises(RuntimeError, match="released"):
        first.wait()
    again = staging.export_blocks([5, 6])
    assert again.in_staging and again.wait().data_ptr() == first_ptr  # the same region
    assert same_bytes(again.wait(), ref_kv_pack(cache, torch.tensor([5, 6])))
    assert same_bytes(second.wait(), ref_kv_pack(cache, torch.tensor([2, 3])))  # untouched

    too_big = staging.export_blocks(list(range(6)))  # larger than the whole area
    assert not too_big.in_staging and staging.num_one_off == 2
    assert same_bytes(too_big.wait(), ref_kv_pack(cache, torch.arange(6)))

    # released from another thread (the event loop's), or dropped unreleased: returned
    releaser = threading.Thread(target=second.release)
    releaser.start()
    releaser.join()
    assert arena.num_dropped == 0
    del again
    gc.collect()
    assert arena.free_bytes == arena.capacity and arena.num_dropped == 1
    whole = staging.export_blocks([8, 9, 10, 11])  # one region again, merged back
    assert whole.in_staging and whole.wait().data_ptr() == first_ptr


def test_no_staging_area_still_exports() -> None:
    cache = random_cache(torch.bfloat16)
    staging = KVStaging(cache, 0, use_kernels=True)
    got = staging.export_blocks([3, 1])
    assert not got.in_staging and staging.num_one_off == 1
    assert same_bytes(got.wait(), ref_kv_pack(cache, torch.tensor([3, 1])))
    with pytest.raises(ValueError, match=">= 0"):
        KVStaging(cache, -1)


def test_payload_bytes_refuses_a_device_tensor() -> None:
    with pytest.raises(ValueError, match="host memory"):
        payload_bytes(torch.zeros(4, device="meta"))
    assert payload_bytes(torch.ones(2)).nbytes == 8


# -- two engines, the handoff through the kernels ------------------------------------------


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(12)]  # 3 blocks of 4
    return [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 2)] + [
        [rng.randrange(3, 512) for _ in range(3)]  # shorter than a block
    ]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2))  # hidden 64, 2 layers


def engine(model_dir: Path, use_kernels: bool, device: str = "cpu") -> LLMEngine:
    config = EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=48, device=device)
    eng = LLMEngine(model_dir, config)
    if use_kernels:  # what a CUDA engine gets by default
        eng.kv_staging = KVStaging(eng.runner.kv_cache, 1 << 20, use_kernels=True)
    return eng


def run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] = out.token_ids
    return tokens


def disaggregated(model_dir: Path, use_kernels: bool, device: str = "cpu") -> Any:
    """Prefill each prompt on one engine, decode it on another: (tokens, payload bytes)."""
    p_eng, d_eng = engine(model_dir, use_kernels, device), engine(model_dir, use_kernels, device)
    tokens, payloads = {}, []
    for i, prompt in enumerate(prompts()):
        rid = f"r{i}"
        p_eng.add_request(rid, prompt, PREFILL, hold_kv=True)
        (first,) = run_to_end(p_eng)[rid]
        hashes = hash_block_chain(prompt, BLOCK, d_eng.hash_namespace)[: (len(prompt) - 1) // BLOCK]
        skip = len(d_eng.block_pool.get_computed_blocks(hashes))
        export = p_eng.export_kv(rid, first_block=skip)
        assert export.first_token == first
        payload = export.wait()
        assert payload.device.type == "cpu"
        payloads.append(as_bytes(payload).clone())
        out = d_eng.add_prefilled_request(rid, prompt, first, GREEDY, payload, first_block=skip)
        export.release()
        p_eng.release_kv(rid)
        assert out.num_cached_tokens == skip * BLOCK
        tokens.update(run_to_end(d_eng))
    for eng in (p_eng, d_eng):
        eng.block_pool.check_no_leaks()
        arena = eng.kv_staging.arena
        assert arena.free_bytes == arena.capacity and arena.num_dropped == 0
    return tokens, payloads


def test_engine_handoff_through_the_kernels_gives_the_same_tokens(model_dir: Path) -> None:
    colocated = engine(model_dir, use_kernels=False)
    for i, prompt in enumerate(prompts()):
        colocated.add_request(f"r{i}", prompt, GREEDY)
    expected = run_to_end(colocated)
    by_kernels, kernel_bytes = disaggregated(model_dir, use_kernels=True)
    by_torch, torch_bytes = disaggregated(model_dir, use_kernels=False)
    assert by_kernels == by_torch == expected
    assert [p.numel() for p in kernel_bytes] == [p.numel() for p in torch_bytes]
    assert all(torch.equal(a, b) for a, b in zip(kernel_bytes, torch_bytes, strict=True))
    # the second prompt shares the first's 3 cached blocks: only its tail crossed
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4
    assert [p.numel() // block_bytes for p in kernel_bytes] == [5, 1, 1]


async def serve_through_workers(
    model_dir: Path, use_kernels: bool, device: str = "cpu"
) -> dict[str, list[int]]:
    """Prefill worker -> loopback -> decode worker; then a push that fails. The prefill
    side's staging regions must all be back after each (sent or not)."""
    hub = LoopbackHub()
    p_async = AsyncEngine(engine(model_dir, use_kernels, device))
    d_async = AsyncEngine(engine(model_dir, use_kernels, device))
    layout = layout_of(d_async.engine.runner.kv_cache)
    decode = DecodeWorker(
        d_async, LoopbackReceiver(hub, ReceiverConfig(TOKEN, layout)), kv_wait_timeout_s=30
    )
    prefill = PrefillWorker(p_async, LoopbackSender(hub), TOKEN)
    arena = p_async.engine.kv_staging.arena
    address = await decode.start()
    tokens: dict[str, list[int]] = {}
    try:
        for i, prompt in enumerate(prompts()):
            rid = f"r{i}"
            decode.expect_kv(rid, prompt)
            info: dict[str, Any] = {}
            last = None
            pushed = asyncio.ensure_future(prefill.prefill(rid, prompt, GREEDY, address))
            async for out in decode.generate(rid, prompt, GREEDY, kv_expected=True, info=info):
                last = out
            await pushed
            assert info["kv_used"] and last is not None
            tokens[rid] = last.token_ids
            assert arena.free_bytes == arena.capacity
        with pytest.raises(UnknownRequestError):  # nobody expects it: refused
            await prefill.prefill("stray", prompts()[0], GREEDY, address)
        assert arena.free_bytes == arena.capacity
        assert arena.num_dropped == 0  # released by the worker, not by the collector
    finally:
        await decode.close()
        await p_async.close()
        await d_async.close()
    return tokens


def test_workers_hand_off_through_the_kernels_and_release_staging(model_dir: Path) -> None:
    colocated = engine(model_dir, use_kernels=False)
    for i, prompt in enumerate(prompts()):
        colocated.add_request(f"r{i}", prompt, GREEDY)
    expected = run_to_end(colocated)
    run = serve_through_workers(model_dir, use_kernels=True)
    assert asyncio.run(asyncio.wait_for(run, 120)) == expected


# -- the CUDA path ----------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_export_stages_in_pinned_memory_on_a_side_stream(dtype: torch.dtype) -> None:
    cache = random_cache(dtype, "cuda", num_blocks=64)
    staging = KVStaging(cache, 1 << 20)
    assert staging.use_kernels and staging.staged and staging.arena.capacity == 1 << 20
    ids = [40, 3, 17, 8]
    want = ref_kv_pack(cache.cpu(), torch.tensor(ids))
    staged = staging.export_blocks(ids)
    # the compute stream rewrites the blocks right after: the pack ran before, in order
    cache[:, :, ids] = 0
    got = staged.wait()
    assert staged.ready() and staged.in_staging
    assert got.device.type == "cpu" and got.is_pinned() and got.is_contiguous()
    assert same_bytes(got, want)
    ptr = got.data_ptr()
    staged.release()
    again = staging.export_blocks([1, 2])
    assert again.wait().data_ptr() == ptr  # the same pinned region, reused
    big = staging.export_blocks(list(range(64)))  # larger than 1 MiB of staging: one-off
    assert not big.in_staging and staging.num_one_off == 1 and big.wait().is_pinned()
    assert same_bytes(big.wait(), ref_kv_pack(cache.cpu(), torch.arange(64)))

    target = torch.zeros_like(cache)
    KVStaging(target, 0).import_blocks(want, [60, 0, 5, 9])
    assert same_bytes(target[:, :, [60, 0, 5, 9]].cpu(), want)
    assert torch.count_nonzero(target) == torch.count_nonzero(want)


@needs_cuda
def test_cuda_engines_and_workers_hand_off_through_the_kernels(model_dir: Path) -> None:
    colocated = engine(model_dir, use_kernels=False, device="cuda")
    for i, prompt in enumerate(prompts()):
        colocated.add_request(f"r{i}", prompt, GREEDY)
    expected = run_to_end(colocated)
    tokens, _ = disaggregated(model_dir, use_kernels=False, device="cuda")  # CUDA default
    assert tokens == expected
    run = serve_through_workers(model_dir, use_kernels=False, device="cuda")
    assert asyncio.run(asyncio.wait_for(run, 120)) == expected


# -- the device side's bounds and ordering (CPU stand-ins for CUDA's) -------------------


def test_a_payload_crosses_the_device_in_chunks_of_whole_layers() -> None:
    from pdserve.engine.worker.kv_staging import (
        DEVICE_CHUNK_BYTES,
        handoff_device_bytes,
        layer_chunks,
    )

    mib = 1 << 20
    assert layer_chunks(32, 8 * mib) == [(0, 32)]  # 256 MiB: one chunk
    assert layer_chunks(32, 16 * mib) == [(0, 16), (16, 32)]
    assert layer_chunks(3, 300 * mib) == [(0, 1), (1, 2), (2, 3)]  # a layer past the bound
    assert handoff_device_bytes(64 * mib, 32) == 64 * mib  # small: the payload itself
    assert handoff_device_bytes(1 << 30, 32) == DEVICE_CHUNK_BYTES
    assert handoff_device_bytes(16 << 30, 32) == 512 * mib  # one layer is the least


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _Stream:
    def __init__(self) -> None:
        self.waited: list[_Event] = []

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event)


def test_a_step_waits_only_for_the_imports_into_its_blocks() -> None:
    """An asynchronous import (CUDA) is waited for on the device by the first step that
    touches one of its blocks, and by no other; once its event is passed, what it kept
    alive (the pinned source, the device chunk) goes."""
    from pdserve.engine.worker.kv_staging import PendingImports

    imports, stream = PendingImports(), _Stream()
    a, b = _Event(), _Event()
    source = torch.zeros(4)
    imports.add([1, 2], a, keep=(source,))
    imports.add([7], b)
    assert imports.order({3, 4}, lambda: stream) == 0 and stream.waited == []
    assert imports.order({2, 9}, lambda: stream) == 1 and stream.waited == [a]
    assert imports.order({1}, lambda: stream) == 0, "waited for once is enough"
    assert len(imports) == 2
    a.done = True
    assert imports.order({5}, lambda: stream) == 0 and len(imports) == 1  # `a` let go
    assert imports.order(None, lambda: stream) == 1 and stream.waited == [a, b]  # all
    b.done = True
    imports.order(None, lambda: stream)
    assert len(imports) == 0
