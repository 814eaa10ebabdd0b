"""The training loop: AdamW, warm-up then cosine decay, bf16 autocast on CUDA, gradient clipping, stopping by the
clock (or a step count), progress lines, periodic held-out evaluation through the engine.

Phases, by the fraction of training done ``p`` (of the time budget, or of ``steps`` when that comes first):

- ``p < sparse_from``: dense attention in the DSA layers; their indexers learn the main attention's
  distribution by KL (the warm-up of DeepSeek-V3.2, here while the main model trains too);
- ``p >= sparse_from``: sparse attention over the indexers' top-k, the indexers' KL over the selected keys;
- ``p >= qat_from`` (MXFP4 checkpoints): routed experts through MXFP4 rounding with a straight-through gradient.

The loss is ``lm + balance_alpha · balance``; the indexers' KL is back-propagated to the indexers' parameters
only, and the routers' selection biases move towards balance after each step (:mod:`dayzero.train.routing`).
"""
from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dayzero.train import routing
from dayzero.train.batch import TrainBatch
from dayzero.train.data import DataConfig, StreamDataset
from dayzero.train.forward import answer_rows, indexer_parameters, losses, moe_layers, training


@dataclass
class TrainConfig:
    seconds: float | None = None  # training time budget (the clock stops it)
    steps: int | None = None  # or a step count (whichever comes first)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    balance_alpha: float = 1e-3
    bias_rate: float = 1e-2  # per step; fast, for runs of a few hundred steps (DeepSeek-V3: 1e-3 over far more)
    sparse_from: float = 0.7
    qat_from: float = 0.85
    fake_mxfp4: bool = True
    kl_rows: int = 256
    log_every: int = 20
    eval_every: float | None = None  # seconds between held-out evaluations (None: none during training)
    seed: int = 0
    workers: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    profile_file: str | None = None  # the profiler's tables of step ``profile_step`` (GPU and host time) go here
    profile_step: int = 3
    # a job split over several processes (a time limit per call): this one stops after ``pause_seconds`` of its own
    # training, or once ``pause_step`` steps are done, and the trainer's state_dict carries the job on
    pause_seconds: float | None = None
    pause_step: int | None = None

    def __post_init__(self):
        if self.seconds is None and self.steps is None:
            raise ValueError("training needs a time budget or a step count")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"the time budget must be positive, got {self.seconds} s")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")


def param_groups(model, weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases, gates' scalars and embeddings (tied to the LM head) do not."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


class _Clock:
    """Seconds per phase of one step, the device synchronised at each mark (only when ``on``)."""

    def __init__(self, device: torch.device, on: bool):
        self.device, self.on, self.marks = device, on, []
        self.last = time.monotonic()

    def mark(self, name: str) -> None:
        if not self.on:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.monotonic()
        self.marks.append((name, now - self.last))
        self.last = now

    def summary(self) -> str:
        return "  [" + " ".join(f"{n} {s * 1e3:.0f}ms" for n, s in self.marks) + "]" if self.marks else ""


class _StepProfile:
    """The torch profiler over one whole step (data to optimizer), started on construction; its tables group the
    ops by name, then by the source lines that called them (``STACK_DEPTH`` frames)."""

    STACK_DEPTH = 6

    def __init__(self, device: torch.device):
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        stacks = _ExperimentalConfig(verbose=True)  # without it no Python frames are kept for the ops
        self.device, self.prof = device, profile(activities=acts, with_stack=True, experimental_config=stacks)
        self.prof.__enter__()

    def write(self, path: str, step: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        keys = (["self_cuda_time_total"] if self.device.type == "cuda" else []) + ["self_cpu_time_total"]
        with open(path, "w") as f:
            for key in keys:
                f.write(f"step {step}, by {key}\n{self.prof.key_averages().table(sort_by=key, row_limit=50)}\n\n")
            stacks = self.prof.key_averages(group_by_stack_n=self.STACK_DEPTH)
            f.write(f"step {step}, by {keys[0]} and calling lines\n"
                    f"{stacks.table(sort_by=keys[0], row_limit=60, max_src_column_width=90)}\n")


def _one_thread(_worker: int) -> None:
    torch.set_num_threads(1)  # a data worker is pure Python: its torch threads would only compete with the step


def _fmt_time(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}:{s % 60:02d}"


class Trainer:
    def __init__(self, model, tokenizer, config: TrainConfig, device: torch.device, log: Callable = print,
                 on_eval: Callable | None = None):
        self.model, self.config, self.device, self.log = model, config, torch.device(device), log
        self.on_eval = on_eval  # on_eval(step) -> rows, called every eval_every seconds
        for m in moe_layers(model):  # selection biases follow the loads, not the gradient
            if m.e_score_correction_bias is not None:
                m.e_score_correction_bias.requires_grad_(False)
        self.indexer_params = indexer_parameters(model)
        fused = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas,
                                     fused=fused)
        self.progress = mp.Value("d", 0.0)
        self.tokenizer = tokenizer
        self.step = self.first_step = 0
        self.start = self.end = None
        self.before = 0.0  # seconds of training of this job in earlier processes (a resumed job)
        self.carried = {"tokens": 0, "answer_tokens": 0, "history": []}
        self.paused = False

    def state_dict(self) -> dict:
        """What a later process needs to carry this job on (with the model's weights): the optimizer's moments,
        the step (the data stream and the schedule follow it) and the seconds of training so far."""
        return {"step": self.step, "seconds": self.seconds(), "optimizer": self.opt.state_dict(), **self.carried}

    def seconds(self) -> float:
        """Seconds of training of this job so far: earlier processes' and this one's until its loop ended."""
        end = self.end if self.end is not None else time.monotonic()
        return self.before + (end - self.start if self.start is not None else 0.0)

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.before = int(state["step"]), float(state["seconds"])
        self.carried = {k: state[k] for k in ("tokens", "answer_tokens", "history")}

    def fraction(self) -> float:
        c = self.config
        p = 0.0
        if c.seconds is not None:
            p = max(p, (self.before + time.monotonic() - self.start) / c.seconds)
        if c.steps is not None:
            p = max(p, self.step / c.steps)
        return min(1.0, p)

    def lr_at(self, p: float) -> float:
        c = self.config
        warm = min(1.0, (self.step + 1) / max(1, c.warmup_steps))
        floor = c.lr * c.min_lr_ratio
        return warm * (floor + (c.lr - floor) * 0.5 * (1 + math.cos(math.pi * p)))

    def _loader(self):
        c = self.config
        ds = StreamDataset(c.data, self.tokenizer, c.seed, self.progress, first=self.step)
        if c.workers == 0:
            return iter(ds)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=c.workers, prefetch_factor=2,
                                             pin_memory=self.device.type == "cuda", worker_init_fn=_one_thread)
        return iter(loader)

    def train(self) -> dict:
        c, model, dev = self.config, self.model, self.device
        self.start, self.end, self.first_step = time.monotonic(), None, self.step
        data = self._loader()
        autocast = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
        moes = moe_layers(model)
        tokens, answer, history = self.carried["tokens"], self.carried["answer_tokens"], list(self.carried["history"])
        last_eval = self.start
        t_log, tok_log = time.monotonic(), 0
        while True:
            p = self.fraction()
            if p >= 1.0:
                break
            if self._pause_now():
                self.paused = True
                break
            self.progress.value = p
            timed = (self.step + 1) % c.log_every == 0  # a logged step times its phases (synchronising)
            clock = _Clock(dev, timed)
            prof = _StepProfile(dev) if c.profile_file and self.step + 1 == c.profile_step else None
            step = next(data)
            clock.mark("data")
            batch = TrainBatch(step.ids.to(dev, non_blocking=True), step.lens, sparse=p >= c.sparse_from,
                               kl_rows=c.kl_rows)
            targets = step.targets.to(dev, non_blocking=True)
            loss_weights = step.loss_weights.to(dev, non_blocking=True)
            routing.set_fake_mxfp4(c.fake_mxfp4 and p >= c.qat_from)
            lr = self.lr_at(p)
            for g in self.opt.param_groups:
                g["lr"] = lr
            with autocast, training(model):
                out = losses(model, batch, targets, loss_weights, rows=answer_rows(step.targets))
                main = out.lm + c.balance_alpha * out.balance
            clock.mark("fwd")
            if out.indexer_kl.requires_grad and self.indexer_params:
                out.indexer_kl.backward(inputs=self.indexer_params, retain_graph=True)
            main.backward()
            clock.mark("bwd")
            gnorm = torch.nn.utils.clip_grad_norm_([p_ for g in self.opt.param_groups for p_ in g["params"]],
                                                   c.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            imbalance = routing.update_bias(moes, out.routes, c.bias_rate)
            clock.mark("opt")
            if prof is not None:
                prof.write(c.profile_file, self.step + 1)
                self.log(f"profiled step {self.step + 1}: tables in {c.profile_file}")
            routing.set_fake_mxfp4(False)
            self.step += 1
            tokens += step.ids.numel()
            tok_log += step.ids.numel()
            answer += out.answer_tokens
            if self.step % c.log_every == 0 or self.step == 1:
                lm, kl, bal, load = out.lm.item(), out.indexer_kl.item(), out.balance.item(), float(imbalance)
                now = time.monotonic()
                rate = tok_log / max(1e-9, now - t_log)
                t_log, tok_log = now, 0
                left, elapsed = self._eta(now), self.before + now - self.start
                self.log(f"step {self.step:>6}  {p:6.1%}  lr {lr:.2e}  loss {lm:.4f}  kl {kl:.4f}  bal {bal:.3f}  "
                         f"load {load:.2f}  gnorm {float(gnorm):.2f}  {'sparse' if batch.sparse else 'dense '}  "
                         f"{rate / 1e3:,.0f}K tok/s  {_fmt_time(elapsed)} elapsed  ETA {_fmt_time(left)}"
                         f"{clock.summary()}")
                history.append({"step": self.step, "loss": lm, "kl": kl})
            if self.on_eval is not None and c.eval_every and time.monotonic() - last_eval >= c.eval_every:
                self.on_eval(self.step)
                last_eval = time.monotonic()
        self.end = time.monotonic()
        self.carried = {"tokens": tokens, "answer_tokens": answer, "history": history}
        return {"steps": self.step, "tokens": tokens, "answer_tokens": answer, "seconds": self.seconds(),
                "history": history, "paused": self.paused}

    def _pause_now(self) -> bool:
        c = self.config
        if c.pause_step is not None and self.step >= c.pause_step:
            return True
        return c.pause_seconds is not None and time.monotonic() - self.start >= c.pause_seconds

    def _eta(self, now: float) -> float:
        c = self.config
        left = []
        if c.seconds is not None:
            left.append(c.seconds - (self.before + now - self.start))
        done = self.step - self.first_step  # this process's steps
        if c.steps is not None and done:
            left.append((now - self.start) / done * (c.steps - self.step))
        return min(left)
