"""The engine: requests in, one scheduler → flat batch → model → sampler step at a time, outputs out."""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dayzero.cache.eviction import POLICIES as EVICTION_POLICIES
from dayzero.cache.quant import KV_CACHE_DTYPES
from dayzero.config.model_config import DTYPES
from dayzero.distributed import SINGLE, ParallelState
from dayzero.distributed.control import world_min
from dayzero.engine.builder import assemble, prepare_weights
from dayzero.engine.detokenizer import IncrementalText
from dayzero.engine.device import configure_threads, resolve_device
from dayzero.engine.images import ImageRunner
from dayzero.engine.outputs import FinalText, cumulative_output, delta_output
from dayzero.engine.overlap import InFlight, needs_resolved_ids, pending_inputs
from dayzero.engine.request import RequestOutput, Sequence, sample_seed
from dayzero.engine.sampler import Sampler, make_generator
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.scheduler import Scheduler
from dayzero.engine.tokenizer import generation_eos_ids, load_tokenizer
from dayzero.layers.moe import MoE, attach_workspace, expert_loads, rebalance_experts, unpack_experts
from dayzero.loader.safetensors_loader import load_weights
from dayzero.quant.workspace import COMPUTE, ExpertWorkspace
from dayzero.models.init import init_random_weights
from dayzero.models.registry import adapter_for, build_model, default_dtype, read_config
from dayzero.multimodal.costs import cache_rows, encoder_bytes
from dayzero.multimodal.families import attach_tower, read_preprocessor_config, tower_problem, vision_family
from dayzero.ops import registry as ops_registry

log = logging.getLogger("dayzero")

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default"


@dataclass
class EngineConfig:
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int | None = None  # tokens per cache block; None: 16, or the compressed rows' stride when larger
    num_cache_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    cache_memory_bytes: int | None = None  # budget for the cache pools; default a fraction of free memory
    cache_memory_fraction: float = 0.5  # share of free memory the cache takes when cache_memory_bytes is None
    load_format: str = "auto"  # "auto": the checkpoint's safetensors; "dummy": random weights (benchmarks, planning)
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "bfloat16" | "float16" | "float32" | "fp8" | "int8"
    index_cache_dtype: str = "auto"  # the indexer keys' cache: "auto" (as kv_cache_dtype) or one of the same kinds
    expert_compute: str = "auto"  # packed MXFP4 experts: "auto" (per step) | "bf16" | "fp8" workspace | "fused"
    high_precision_layers: tuple[int, ...] = ()  # layers whose packed experts are dequantised once at load
    # block-FP8 routed experts multiply activations quantised to e4m3 per token and 128 channels (the checkpoint's
    # dynamic activation scheme, DeepSeek's inference recipe) on FP8 tensor cores; off: the activations enter exactly
    fp8_activations: bool = False
    enforce_eager: bool = False  # True: no CUDA graphs, every step runs eagerly
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes captured (default 1, 2, 4, 8, 16, .. max_num_seqs)
    cuda_graph_max_len: int = 8192  # decode steps whose longest sequence is longer run eagerly
    # prefill and mixed steps of up to this many rows (and tables of up to cuda_graph_max_len tokens) replay
    # graphs captured at load; 0: they run eagerly
    cuda_graph_prefill_tokens: int = 2048
    enable_prefix_caching: bool = True  # reuse the cached blocks (and state snapshots) of a shared prefix
    prefix_snapshot_interval: int = 512  # tokens between state snapshots (models with per-sequence states)
    num_prefix_snapshots: int | None = None  # snapshots kept (default: a seat's, up to 4 from spare memory)
    # which cached block or snapshot goes when its pool is full: "adaptive" (LRU, or as bimodal insertion would
    # when prompts come back in cycles longer than the pool, whichever would have resumed more) or "lru"
    prefix_eviction_policy: str = "adaptive"
    num_threads: int | None = None  # torch's CPU threads; None: fewer than torch's default when the machine is loaded
    # overlap each step's host work with the next step on the device (see step); None: on for CUDA devices
    async_scheduling: bool | None = None
    host_cache_gib: float = 0.0  # pinned host memory for what the prefix cache evicts from the device (0: none)
    # expert-parallel balancing: extra expert slots per MoE layer (a multiple of ep) for copies of the hottest
    # experts, and every how many steps the placement is recomputed from the loads since the last time (0: never)
    num_redundant_experts: int = 0
    eplb_interval: int = 0
    # the job's layout, for the launcher (dayzero.engine.launch), which starts a process per rank and gives each
    # LLMEngine its rank's ParallelState (docs/parallelism.md, "Launching")
    tp: int = 1  # tensor-parallel ranks
    # expert-parallel ranks: 1 (each expert's width split over tp), every rank of a pipeline stage, or a divisor of
    # a stage's ranks G in between (each expert's width split over G / ep ranks)
    ep: int = 1
    pp: int = 1  # pipeline stages
    # attention data parallelism: dp replicas of tp ranks a stage, each holding sequences of its own (ep 1, tp·dp, or
    # one whose expert-TP groups lie inside a replica); the driver gives each request to the replica with the fewest
    dp: int = 1
    # eager steps of several sequences run as up to this many micro-batches (of at least 32 rows), so pipeline
    # stages overlap (0: twice the stages under pp, whole steps without; 1: whole steps)
    pp_micro_batches: int = 0
    distributed_host: str = "127.0.0.1"  # where the ranks meet (rank 0's address); torchrun's MASTER_ADDR wins
    distributed_port: int | None = None  # None: a free port (torchrun's MASTER_PORT wins)

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tp", "ep", "pp", "dp"):
            v = getattr(self, name)
            if v is None and name == "block_size":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("num_redundant_experts", "eplb_interval", "pp_micro_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.num_cache_blocks is not None and self.num_cache_blocks < 2:
            raise ValueError(f"num_cache_blocks must be >= 2 (block 0 is reserved), got {self.num_cache_blocks}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 0 < self.cache_memory_fraction <= 1:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction!r}")
        if self.cache_memory_bytes is not None and (not isinstance(self.cache_memory_bytes, int) or self.cache_memory_bytes < 1):
            raise ValueError(f"cache_memory_bytes must be a positive int, got {self.cache_memory_bytes!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive int or None, got {self.num_threads!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.expert_compute not in COMPUTE:
            raise ValueError(f"expert_compute must be one of {list(COMPUTE)}, got {self.expert_compute!r}")
        self.high_precision_layers = tuple(self.high_precision_layers)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.index_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"index_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.index_cache_dtype!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = tuple(self.cuda_graph_sizes)
            if not self.cuda_graph_sizes or any(not isinstance(v, int) or v < 1 for v in self.cuda_graph_sizes):
                raise ValueError(f"cuda_graph_sizes must be positive ints, got {self.cuda_graph_sizes!r}")
        if not isinstance(self.cuda_graph_max_len, int) or self.cuda_graph_max_len < 1:
            raise ValueError(f"cuda_graph_max_len must be a positive int, got {self.cuda_graph_max_len!r}")
        if isinstance(self.cuda_graph_prefill_tokens, bool) or not isinstance(self.cuda_graph_prefill_tokens, int) \
                or self.cuda_graph_prefill_tokens < 0:
            raise ValueError(f"cuda_graph_prefill_tokens must be an int >= 0, got {self.cuda_graph_prefill_tokens!r}")
        if not isinstance(self.prefix_snapshot_interval, int) or self.prefix_snapshot_interval < 1:
            raise ValueError(f"prefix_snapshot_interval must be a positive int, got {self.prefix_snapshot_interval!r}")
        if self.num_prefix_snapshots is not None and (not isinstance(self.num_prefix_snapshots, int)
                                                      or self.num_prefix_snapshots < 0):
            raise ValueError(f"num_prefix_snapshots must be an int >= 0 or None, got {self.num_prefix_snapshots!r}")
        if self.prefix_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"prefix_eviction_policy must be one of {EVICTION_POLICIES}, "
                             f"got {self.prefix_eviction_policy!r}")
        if isinstance(self.host_cache_gib, bool) or not isinstance(self.host_cache_gib, (int, float)) \
                or not 0 <= self.host_cache_gib < float("inf"):
            raise ValueError(f"host_cache_gib must be a number >= 0, got {self.host_cache_gib!r}")
        if self.distributed_port is not None and (not isinstance(self.distributed_port, int)
                                                  or not 0 < self.distributed_port < 65536):
            raise ValueError(f"distributed_port must be a port number (1..65535) or None, got {self.distributed_port!r}")


class LLMEngine:
    def __init__(self, config: EngineConfig, parallel: ParallelState = SINGLE):
        """``parallel``: this process's rank of a multi-process job (:func:`dayzero.distributed.init_parallel`);
        every rank builds the engine with the same config and is given the same requests (those of its replica,
        under attention data parallelism), loads only its slices of the weights, and samples the same tokens from
        the gathered logits."""
        self.config = config
        if config.num_redundant_experts:
            parallel = dataclasses.replace(parallel, redundant_experts=config.num_redundant_experts)
        self.parallel = parallel
        path = Path(config.model) if config.model else DEFAULT_MODEL
        self.device = resolve_device(config.device)
        ops_registry.env_overrides()  # a bad DAYZERO_OPS stops the start, not the first step
        self.num_threads = configure_threads(config.num_threads)
        dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = DTYPES[dtype]
        self.path = path
        raw, cfg_file = read_config(path)
        adapter = adapter_for(raw, cfg_file)
        self.model_config = adapter.to_spec(raw)
        self.model = build_model(self.model_config, self.dtype, self.device, parallel)
        # m parts over pp stages take (m + pp - 1) / m part-times per step against pp whole ones; replicas that meet
        # in the experts' exchange (attention data parallelism) run whole steps, so that their layers' calls pair
        if parallel.meets_other_replicas and parallel.pp_size > 1:
            if config.pp_micro_batches > 1:
                raise ValueError(f"pp_micro_batches={config.pp_micro_batches} with dp={parallel.dp_size} and "
                                 f"ep={parallel.ep_size}: replicas cut their steps into different numbers of parts, "
                                 "which would not meet in the experts' exchange; leave it at 0 (whole steps)")
            self.model.micro_batches = 1
        else:
            self.model.micro_batches = config.pp_micro_batches or (2 * parallel.pp_size if parallel.pp_size > 1 else 1)
        rules, ignore = adapter.rules(self.model_config), adapter.ignore
        self.vision_family = family = vision_family(raw)
        self.tower_problem = tower_problem(raw)  # a tower in the config that cannot take images: why
        if family is not None:  # the vision tower loads with the text model, from the same files
            with torch.device(self.device), default_dtype(self.dtype):
                attach_tower(self.model, family, raw)
            rules, ignore = rules + family.rules(raw), family.text_ignore(ignore)
        if config.load_format == "dummy":
            init_random_weights(self.model, config.seed)
        else:
            load_weights(self.model, path, rules, ignore)
        self._apply_precision(config)
        self.tokenizer = load_tokenizer(path)
        self.eos_ids = generation_eos_ids(path, self.model_config.eos_ids, self.tokenizer)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        torch.manual_seed(config.seed)

        prepare_weights(self.model)
        processor = None if family is None else family.processor(raw, read_preprocessor_config(path))
        cache_tokens = cache_rows(config.max_num_batched_tokens)
        encoder = 0 if family is None else encoder_bytes(self.model.visual, processor, config.max_num_batched_tokens,
                                                         self.dtype.itemsize)
        built = assemble(
            self.model, self.device, self.dtype, block_size=config.block_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            budget_bytes=config.cache_memory_bytes, memory_fraction=config.cache_memory_fraction,
            num_cache_blocks=config.num_cache_blocks, kv_cache_dtype=config.kv_cache_dtype,
            cuda_graphs=not config.enforce_eager and parallel.ep_size == parallel.pp_size == 1,
            cuda_graph_sizes=config.cuda_graph_sizes,
            cuda_graph_max_len=config.cuda_graph_max_len, cuda_graph_prefill_tokens=config.cuda_graph_prefill_tokens,
            prefix_caching=config.enable_prefix_caching,
            snapshot_interval=config.prefix_snapshot_interval, num_snapshots=config.num_prefix_snapshots,
            eviction_policy=config.prefix_eviction_policy,
            index_cache_dtype=config.index_cache_dtype, host_cache_bytes=int(config.host_cache_gib * 2**30),
            extra_scratch_bytes=encoder,  # the vision encoder's calls and cache
            # ranks of one job must plan the same cache (their schedulers take the same decisions)
            agree=None if parallel.backend is None else lambda values: world_min(values, parallel.device),
        )
        self.runner, self.cache, self.cache_plan, self.decode_mode = built.runner, built.cache, built.plan, built.graph_note
        self.prefill_mode = built.prefill_note  # how prefill and mixed steps run
        if self.device.type == "cuda" and not config.enforce_eager and parallel.ep_size > 1:
            self.decode_mode = self.prefill_mode = "eager (expert parallelism reads its all-to-all split sizes on the host)"
        elif self.device.type == "cuda" and not config.enforce_eager and parallel.pp_size > 1:
            self.decode_mode = self.prefill_mode = "eager (pipeline stages are not captured yet)"
        self.scheduler = Scheduler(self.cache, min(config.max_num_seqs, self.cache_plan.num_slots), config.max_num_batched_tokens)
        self.images = None if family is None else ImageRunner(
            family, self.model.visual, processor, raw, self.device, self.dtype, cache_tokens=cache_tokens)
        self.sampler = Sampler()
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.num_aborted = 0
        overlap = config.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if overlap is None else overlap
        self._inflight: InFlight | None = None  # the queued step whose samples the host has not read yet
        moe = [(i, l.mlp) for i, l in enumerate(self.model.model.layers) if isinstance(getattr(l, "mlp", None), MoE)]
        self.moe_layer_index, self.moe_layers = [i for i, _ in moe], [m for _, m in moe]  # decoder index, layer
        self._load_read: tuple[float, dict] = (-math.inf, {})  # when stats last read the loads, and what
        self.num_steps = 0
        self._balanced_loads: list[torch.Tensor] = []  # the loads at the last rebalance

    def _apply_precision(self, config: EngineConfig) -> None:
        layers = self.model.model.layers
        bad = [i for i in config.high_precision_layers if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"high_precision_layers {bad} are not layer indices (the model has {len(layers)} layers)")
        for i in config.high_precision_layers:
            mlp = getattr(layers[i], "mlp", None)
            if isinstance(mlp, MoE) and mlp.packed:
                unpack_experts(mlp, self.dtype)
        self.expert_workspace = ExpertWorkspace(config.expert_compute, self.device,
                                                fp8_activations=config.fp8_activations)
        self.packed_moe_layers = attach_workspace(self.model, self.expert_workspace)
        fp8_layers = [m for m in self.model.modules() if isinstance(m, MoE) and m.fp8]
        for m in fp8_layers:
            m.fp8_activations = config.fp8_activations
        if config.fp8_activations and not fp8_layers and not (self.packed_moe_layers and self.expert_workspace.tiles):
            log.warning("fp8_activations: the model has no block-FP8 routed experts and no MXFP4 experts converted "
                        "into an FP8 workspace (expert_compute auto or fp8); nothing changes")

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    delta: bool = False, images: list | None = None):
        """Queue a request (``n`` sequences); raises ValueError, naming the limit, for one that cannot run.
        ``delta``: its outputs carry only what is new since its last one (token ids, logprobs, text that can
        no longer change), so that a consumer never copies or holds more than one step's worth per step.

        ``images`` (Pillow images, or encoded bytes): the prompt holds exactly one image placeholder token per
        image (``image_token_id`` of the config), in order; each is widened to the image's tokens, which count
        as prompt tokens. ValueError for a model without a vision tower, a placeholder count that is not the
        image count, an unreadable image, or an expanded prompt over the context."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids, mm = self.prepare_prompt(list(prompt_token_ids), list(images or []))
        max_tokens = self.check_request(ids, params)
        seqs = []
        for i in range(params.n):
            gen = make_generator(sample_seed(params.seed, i), self.device) if params.seed is not None else None
            seq = Sequence(request_id, i, list(ids), len(ids), params, generator=gen, max_tokens=max_tokens, delta=delta,
                           images=mm)
            seqs.append(seq)
        self.requests[request_id] = seqs
        self.prompts[request_id] = prompt
        for seq in seqs:
            self.scheduler.add(seq)

    def prepare_prompt(self, ids: list[int], images: list):
        """(prompt ids with the image placeholders widened, the request's images or None), or the ValueError that
        refuses them (images for a model without a vision tower, a placeholder count that is not the image
        count, an unreadable image, an expanded prompt over the context). With :meth:`check_request`, the
        checks of :meth:`add_request`, for a caller that checks a request before sending it elsewhere."""
        if self.images is None:
            if images:
                why = self.tower_problem or "its checkpoint has no vision tower"
                raise ValueError(f"model {self.model_config.model_type!r} does not take images ({why})")
            return ids, None
        bad = [t for t in ids if not isinstance(t, int)]
        if bad:
            raise ValueError(f"prompt token ids must be ints, got {bad[:5]}")
        wide, mm = self.images.prepare(ids, images)
        if mm is not None and len(wide) >= self.max_model_len:
            raise ValueError(f"prompt has {len(wide)} tokens with its {len(images)} image(s) expanded to "
                             f"{len(wide) - len(ids) + len(images)} image tokens; the context length is "
                             f"{self.max_model_len} (at least one token must be left to generate)")
        return wide, mm

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens (an omitted one is what fits in the context and the cache), or the
        ValueError that refuses it. Adds nothing: a caller can check several requests before adding any."""
        ids = prompt_token_ids
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, the context length is {self.max_model_len} (at least one token must be left to generate)")
        capacity = self.cache.capacity_tokens() if self.cache.uses_blocks else math.inf
        whole_cache = (f"the whole cache holds {capacity} ({self.cache_plan.num_blocks - 1} blocks of "
                       f"{self.cache_plan.block_size})")
        if params.max_tokens is None:  # the rest of the context, or of the cache when that is smaller
            max_tokens = min(self.max_model_len, capacity) - len(ids)
            if max_tokens < 1:
                raise ValueError(f"prompt has {len(ids)} tokens but {whole_cache}, and at least one token must be "
                                 f"left to generate; raise num_cache_blocks")
            return max_tokens
        max_tokens = params.max_tokens
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, max_tokens {max_tokens}, context length {self.max_model_len}")
        if len(ids) + max_tokens > capacity:
            raise ValueError(f"request needs up to {len(ids) + max_tokens} tokens of cache but {whole_cache}; "
                             f"lower max_tokens or raise num_cache_blocks")
        return max_tokens

    def abort(self, request_id: str) -> bool:
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        self.prompts.pop(request_id, None)
        for seq in seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
            if seq.images is not None:
                self.images.release(seq)
        self.num_aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def close(self) -> None:
        """Nothing to release in one process (a multi-process engine's driver stops its workers here)."""

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step. Returns, for every request that got a token in it, its outputs so far
        (cumulative token ids and text; for a request added with ``delta``, what is new since its last
        output); ``finished`` is set once all its sequences are done, and a finished request is forgotten
        by the engine.

        With ``async_scheduling`` the step overlaps with the next one: the tokens sampled in a step stay on the
        device as the next step's inputs, that step is scheduled and queued, and only then does the host wait
        for them, to append them, check stops and report. So ``step`` returns the outputs of the step before
        the one it queued, and a sequence that stops on a token runs one step past it (its row is discarded)."""
        prev, self._inflight = self._inflight, None
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.parallel.meets_other_replicas:
                self._idle_step()
            if prev is not None:
                return self._resolve(prev)
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress: a waiting sequence can never fit in the cache")
            return []
        self.num_steps += 1
        if self.config.eplb_interval and self.num_steps % self.config.eplb_interval == 0:
            self.rebalance_experts()
        self.runner.copy_states(self.cache.take_restores())  # prefix hits start from their snapshot's states
        images, rope = self.images.step_inputs(scheduled) if self.images is not None else (None, None)
        batch = self.runner.build_batch(scheduled, self.cache, eager=images is not None or rope is not None,
                                        # inputs still on the device: the previous step's samples
                                        pending=pending_inputs(scheduled, prev) if prev is not None else None)
        batch.images = images
        if rope is not None:  # [3, T] over the 1-D positions the runner wrote
            batch.rope_positions = rope
        logits = self.runner.execute(batch)
        to_sample = [s.seq for s in scheduled if s.samples]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        outputs: list[RequestOutput] = []
        if prev is not None and (not self.async_scheduling or needs_resolved_ids(to_sample)):
            outputs, prev = self._resolve(prev), None  # penalties count the ids of every generated token
        out = None
        if to_sample:
            # generated ids only where penalties read them (copying every output list costs O(length) a step)
            ids = [q.output_ids if q.params.penalised else () for q in to_sample]
            out = self.sampler(logits, [q.params for q in to_sample], [q.generator for q in to_sample], ids)
            sampled = InFlight(to_sample, out.token_ids, out.copy_to_host([q.params.logprobs or 0 for q in to_sample]))
        if out is not None and self.async_scheduling:
            for q in to_sample:
                if not q.finished:
                    q.add_pending(self.max_model_len)
            self._inflight = sampled
        if prev is not None:
            outputs = self._resolve(prev)
        self._commit(scheduled)
        if self.images is not None:
            self.images.after_step(scheduled)
        if out is not None and not self.async_scheduling:
            outputs = self._resolve(sampled)
        return outputs

    def _idle_step(self) -> None:
        """Attention data parallelism: a step with nothing of this replica's to run still meets the other
        replicas in every MoE layer's expert exchange, and counts as a step (a rebalance comes at the same step
        on every rank)."""
        self.num_steps += 1
        if self.config.eplb_interval and self.num_steps % self.config.eplb_interval == 0:
            self.rebalance_experts()
        with torch.inference_mode():
            for m in self.moe_layers:
                m.idle(self.dtype)

    def _commit(self, scheduled) -> None:
        """The step's full blocks join the prefix cache and its snapshot points copy the states out, queued
        before any later step can change them. Every input token's id is on the host by now."""
        snapshots = []
        for s in scheduled:
            if s.seq.finished:  # ended (a stop, an abort) while the step ran: its cache is gone
                continue
            snap = self.cache.commit(s.seq.seq_id, s.seq.token_ids, s.seq.num_computed, s.seq.num_prompt_tokens,
                                     s.seq.block_keys)
            if snap is not None:
                snapshots.append(snap)
        self.runner.copy_states(snapshots)
        self.cache.snapshots_copied(snapshots)

    def _resolve(self, step: InFlight) -> list[RequestOutput]:
        """Wait for a step's samples on the host and append them (the step's one device -> host copy)."""
        host = step.host.result()
        tops = host.top or [[]] * len(step.seqs)
        touched: dict[str, None] = {}
        for seq, tok, lp, top in zip(step.seqs, host.token_ids, host.logprobs, tops):
            if seq.finished:  # aborted, or stopped before this token: the step ran its row for nothing
                continue
            self._append(seq, tok, lp, top)
            touched[seq.request_id] = None
        return [self._output(r) for r in touched if r in self.requests]

    def _append(self, seq: Sequence, tok: int, logprob: float, top: list[tuple[int, float]] = ()) -> None:
        p = seq.params
        if tok < 0:  # the sampler found NaN/inf logits: end this request, keep the others
            seq.finish_reason = "error"
            self.scheduler.finish(seq)
            return
        seq.resolve(tok)
        seq.logprobs.append(logprob)
        seq.top_logprobs.append(list(top))
        n_out = seq.num_output
        reason = None
        if n_out >= p.min_tokens and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            reason, seq.stop_reason = "stop", (tok if tok in p.stop_token_ids else None)
        elif self.tokenizer is not None:
            if seq.detok is None:
                seq.detok = IncrementalText(self._decode)
            before = len(seq.detok.text)
            if seq.detok.update(seq.token_ids, seq.num_prompt_tokens, seq.num_resolved) and p.stop and n_out >= p.min_tokens:
                # a stop string the new text completes starts at most (longest stop - 1) characters back
                text, start = seq.detok.text, max(0, before - max(map(len, p.stop)) + 1)
                hits = [(at, s) for s in p.stop if (at := text.find(s, start)) >= 0]
                if hits:
                    at, s = min(hits)
                    seq.text = text[: at + (len(s) if p.include_stop_str_in_output else 0)]
                    reason, seq.stop_reason = "stop", s
        if reason is None and (n_out >= seq.max_tokens or seq.num_resolved >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        finished = all(q.finished for q in seqs)
        prompt = self.prompts.get(request_id)
        texts = FinalText(self._decode, self.eos_ids)
        if seqs[0].delta:
            outs = [o for q in seqs if (o := delta_output(q, texts)) is not None]
            prompt_ids = []  # the caller has them; not copied again every step
        else:
            outs = [cumulative_output(q, texts) for q in seqs]
            prompt_ids = seqs[0].token_ids[: seqs[0].num_prompt_tokens]
        if finished:
            del self.requests[request_id]
            self.prompts.pop(request_id, None)
        return RequestOutput(request_id, prompt, prompt_ids, outs, finished)

    def cache_usage(self) -> dict[str, int]:
        return self.cache.usage()

    def stats(self) -> dict:
        """Counters for metrics: queue lengths, cache use, preemptions, aborts, model steps by kind (decode,
        prefill) and how they ran (a replayed CUDA graph, eager), and the expert loads (read from
        the device at most once a second while requests run, as decoder layer index -> pairs per expert: a read
        waits for the queued steps)."""
        now = time.monotonic()
        idle = not (self.scheduler.running or self.scheduler.waiting)
        if self.moe_layers and (now - self._load_read[0] >= 1.0 or idle):
            self._load_read = (now, dict(zip(self.moe_layer_index, self.expert_load())))
        return {
            **self.counters(), "expert_load": self._load_read[1], "ep_size": self.parallel.ep_size,
            "model_steps": dict(self.runner.step_counts),
            **(self.images.stats() if self.images is not None else {"encoder_runs": 0, "encoder_cache_hits": 0}),
        }

    def counters(self) -> dict[str, int]:
        """The host-side counts of :meth:`stats` (queues, cache use, preemptions, aborts): cheap, no device read."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "preemptions": self.scheduler.num_preemptions, "aborts": self.num_aborted, **self.cache.usage()}

    def rebalance_experts(self) -> int:
        """Recompute every expert-parallel MoE layer's placement from the loads since the last rebalance and
        move the experts there (each rank at the same step); returns the expert slots that changed. Outputs do
        not change: every copy of an expert holds the same weights."""
        loads = self.expert_load()
        window = [l - p for l, p in zip(loads, self._balanced_loads)] if self._balanced_loads else loads
        self._balanced_loads = loads
        return rebalance_experts(self.moe_layers, window)

    def expert_load(self) -> list[torch.Tensor]:
        """Per MoE layer, the (token, expert) pairs routed to each expert since the start, host int64
        [n_experts] (every rank's tokens under expert parallelism); one read of the device."""
        return expert_loads(self.moe_layers)
