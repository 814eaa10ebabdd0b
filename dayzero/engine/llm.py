"""``LLM``: offline generation through the engine (scheduler → flat batch → model → sampler)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from dayzero.engine.engine import EngineConfig
from dayzero.engine.launch import start_engine
from dayzero.engine.request import RequestOutput
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.tokenizer import chat_end_of_turn_ids, with_end_of_turn
from dayzero.multimodal.content import MediaPolicy, image_list, load_chat

PromptType = str | dict[str, Any]


class LLM:
    """``LLM()`` loads the bundled default model; ``LLM(model="path/to/ckpt")`` a checkpoint directory.

    ``device``: "auto" (CUDA when present, else CPU) | "cpu" | "cuda" | "cuda:N" (a device that is not there
    raises ValueError); ``dtype``: "auto" (bf16 on GPU, fp32 on CPU) | "bfloat16" | "float32".
    ``num_threads``: torch's CPU threads (default: torch's count, or the cores other processes leave free when
    the machine is loaded; logged). ``cache_memory_bytes`` is the cache budget (default
    ``cache_memory_fraction`` of free memory); ``num_cache_blocks`` overrides the pool size computed from it;
    ``max_num_batched_tokens`` is the per-step token budget, and so the prefill chunk size;
    ``kv_cache_dtype`` "fp8" or "int8" stores paged caches quantised (keys per channel, values per token);
    ``index_cache_dtype`` sets the indexer keys' cache apart from it ("fp8": e4m3 with one scale per key).
    Packed MXFP4 experts are converted per layer into one shared workspace in ``expert_compute`` ("bf16" or
    "fp8"), read packed by the expert kernels ("fused", no workspace), or per step ("auto", the default: packed
    for steps of few rows per expert such as decode, a bf16 workspace for large prefill steps); ``high_precision_layers`` lists layers whose experts are instead dequantised once at load.
    ``fp8_activations``: block-FP8 routed experts (DeepSeek's 128×128 tiles) multiply activations quantised to
    e4m3 per token and 128 channels, on FP8 tensor cores (the checkpoint's dynamic activation scheme); off by
    default (the activations enter exactly).
    ``load_format="dummy"`` gives random weights from the config alone (``model`` may then be a config file).
    On CUDA, decode steps run as CUDA graphs captured at load for the batch sizes ``cuda_graph_sizes`` (default
    1, 2, 4, 8, 16, 24, .. ``max_num_seqs``) and contexts up to ``cuda_graph_max_len`` tokens, and prefill and
    mixed steps of up to ``cuda_graph_prefill_tokens`` rows (0: none) as graphs of power-of-two row counts
    (from 32), one sequence or up to ``max_num_seqs``, padded; ``enforce_eager`` turns them all off. ``async_scheduling`` overlaps each step's host work (appending tokens, stop checks, text)
    with the next step on the device (``LLMEngine.step``); the outputs are the same. By default (None) it is on
    for CUDA devices, where the device runs ahead of the host, and off on CPUs, where it would gain nothing.
    ``host_cache_gib`` of pinned host memory keep the prefix-cache blocks and snapshots the device evicts, for
    later hits.

    ``pp`` pipeline stages of ``max(tp · dp, ep)`` ranks (``tp`` tensor-parallel, ``ep`` expert-parallel: 1, every
    rank of a stage, or a divisor of them, each expert's width then split over the stage's ranks / ep; ``dp``
    replicas of tp ranks that each hold sequences of their own (attention data parallelism: ep 1, tp · dp, or
    expert-TP groups inside a replica); ``num_redundant_experts`` and ``eplb_interval`` balance the experts;
    ``pp_micro_batches``: the parts a step of several sequences is cut into so the stages overlap, 0: two per stage)
    run one process each: this one is rank 0, the others are spawned on this host and meet on
    ``distributed_host:distributed_port`` (loopback and a free port by default), or, under torchrun, are the job's
    other processes, where ``LLM(...)`` does not return but serves rank 0 until it closes (``docs/parallelism.md``).
    A rank that dies makes every later call raise ``RankFailure`` (a ``RuntimeError``) naming it. ``close()`` (or
    ``with LLM(...) as llm:``, or the end of the interpreter) stops the other ranks.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int | None = None,
        num_cache_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        seed: int = 0,
        cache_memory_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        index_cache_dtype: str = "auto",
        expert_compute: str = "auto",
        fp8_activations: bool = False,
        high_precision_layers: tuple[int, ...] | list[int] = (),
        load_format: str = "auto",
        enforce_eager: bool = False,
        cuda_graph_sizes: Seq[int] | None = None,
        cuda_graph_max_len: int = 8192,
        cuda_graph_prefill_tokens: int = 2048,
        cache_memory_fraction: float = 0.5,
        num_threads: int | None = None,
        enable_prefix_caching: bool = True,
        prefix_snapshot_interval: int = 512,
        num_prefix_snapshots: int | None = None,
        prefix_eviction_policy: str = "adaptive",
        async_scheduling: bool | None = None,
        host_cache_gib: float = 0.0,
        tp: int = 1,
        ep: int = 1,
        pp: int = 1,
        dp: int = 1,
        pp_micro_batches: int = 0,
        num_redundant_experts: int = 0,
        eplb_interval: int = 0,
        distributed_host: str = "127.0.0.1",
        distributed_port: int | None = None,
    ):
        self.engine = start_engine(EngineConfig(
            model=model, device=device, dtype=dtype, block_size=block_size, num_cache_blocks=num_cache_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            seed=seed, cache_memory_bytes=cache_memory_bytes, kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype=index_cache_dtype, expert_compute=expert_compute, fp8_activations=fp8_activations,
            high_precision_layers=tuple(high_precision_layers), load_format=load_format,
            enforce_eager=enforce_eager, cuda_graph_sizes=cuda_graph_sizes, cuda_graph_max_len=cuda_graph_max_len,
            cuda_graph_prefill_tokens=cuda_graph_prefill_tokens, cache_memory_fraction=cache_memory_fraction, num_threads=num_threads,
            enable_prefix_caching=enable_prefix_caching, prefix_snapshot_interval=prefix_snapshot_interval,
            num_prefix_snapshots=num_prefix_snapshots, prefix_eviction_policy=prefix_eviction_policy,
            async_scheduling=async_scheduling, host_cache_gib=host_cache_gib,
            tp=tp, ep=ep, pp=pp, dp=dp, pp_micro_batches=pp_micro_batches, num_redundant_experts=num_redundant_experts,
            eplb_interval=eplb_interval,
            distributed_host=distributed_host, distributed_port=distributed_port,
        ))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other ranks, if any (nothing to do for one process)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int], list]:
        """(text, token ids, images) of a prompt: a str, or a dict with ``prompt_token_ids`` or ``prompt`` and
        optionally ``multi_modal_data={"image": image or [images]}`` (Pillow images or encoded bytes; the prompt
        holds one image placeholder token per image)."""
        images = []
        if isinstance(prompt, dict):
            images = image_list(prompt.get("multi_modal_data"))
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), images
            if not isinstance(prompt.get("prompt"), str):
                raise ValueError("a dict prompt needs 'prompt_token_ids' or a str 'prompt'")
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: give prompts as {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=False), images

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(params)} sampling params")
        encoded = [self._prompt_ids(p) for p in prompts]  # validate everything before queueing anything
        ids = []
        try:
            for (text, tokens, images), p in zip(encoded, params):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, tokens, p, prompt=text, images=images or None)
                ids.append(rid)
            done: dict[str, RequestOutput] = {}
            bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
            bar.close()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [done[r] for r in ids]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, use_tqdm: bool = False,
        media: MediaPolicy | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's own chat template, then generates. A message's content may be a list of OpenAI-style
        parts: ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": "data:image/...;
        base64,..."}}`` or ``{"type": "image", "image": <Pillow image>}``; the template renders each image part
        as the family's placeholder (e.g. ``<|vision_start|><|image_pad|><|vision_end|>``). ``media``: where image
        URLs may point (:class:`~dayzero.multimodal.content.MediaPolicy`; by default data URLs and inline images
        only, nothing read from disk or fetched)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        sampling_params = self._chat_params(sampling_params, len(convs))
        prompts = []
        for c in convs:
            rendered, images = load_chat(c, media or MediaPolicy())
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_params(self, sampling_params, n: int) -> list[SamplingParams]:
        """Each conversation's parameters, stopping at the template's end-of-turn token as at EOS (the reply
        ends with the assistant's turn, as the server's chat API ends it)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        end = chat_end_of_turn_ids(self.tokenizer)
        return [dataclasses.replace(p, stop_token_ids=with_end_of_turn(p.stop_token_ids, end, p.ignore_eos))
                for p in params]
