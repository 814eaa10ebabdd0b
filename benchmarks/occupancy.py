"""Every Triton launch of one decode step, with its grid and what its programs hold of an SM: which kernels fill
the device, and which leave no room for the next kernel's programs to start before they end.

    python benchmarks/occupancy.py --config configs/dayzero-small.json [--batch 1] [--prompt-len 512]

Under programmatic dependent launch a kernel's programs are scheduled while the one before it runs and wait at
their first statement, reading their model weights before that wait; that overlap needs room on the SMs beside
the running kernel's programs. For each launch this prints its programs, warps, registers a thread, spills,
shared memory, the programs an SM holds at once (registers, warps, shared memory and the block limit), the
waves its grid takes, the share of the device's register file its resident programs hold, and the share of the
next launch's programs that fit beside all of them ("next fits"; registers only). Then the same by kernel name.

The step runs eagerly (``enforce_eager``: a replayed graph issues no Python launches), so the launches are those
the captured graph holds; cuBLAS and torch kernels are not listed. One step's launches are the difference
between generating N and N + 1 tokens. Needs a CUDA device (the compiled kernels' registers come from the driver).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# per SM, sm_80 / sm_90: registers, warps, resident blocks; registers go to a warp in units of this many
REGS, WARPS, BLOCKS, REG_UNIT = 65536, 64, 32, 256
SMEM_RESERVED = 1024  # bytes the hardware keeps per resident block


@dataclass
class Launch:
    name: str
    programs: int
    warps: int
    regs: int  # a thread's
    smem: int  # bytes a program
    spills: int = 0


def per_sm(launch: Launch, smem_per_sm: int = 233472) -> int:
    """Programs of ``launch`` an SM holds at once: the least of what its registers, warps, shared memory and the
    block limit allow."""
    per_warp = math.ceil(launch.regs * 32 / REG_UNIT) * REG_UNIT
    by_regs = (REGS // per_warp) // launch.warps if per_warp else BLOCKS
    by_smem = smem_per_sm // (launch.smem + SMEM_RESERVED)
    return max(0, min(by_regs, WARPS // launch.warps, by_smem, BLOCKS))


def program_regs(launch: Launch) -> int:
    return math.ceil(launch.regs * 32 / REG_UNIT) * REG_UNIT * launch.warps


def next_fits(a: Launch, b: Launch, sms: int) -> float:
    """The share of ``b``'s programs that fit, by registers, beside all of ``a``'s resident programs (spread
    evenly over ``sms``)."""
    held = math.ceil(min(a.programs, per_sm(a) * sms) / sms) * program_regs(a)
    room = min((REGS - held) // program_regs(b), per_sm(b)) * sms
    return min(1.0, max(0, room) / b.programs) if b.programs else 1.0


def rows(launches: list[Launch], sms: int) -> list[dict]:
    out = []
    for i, a in enumerate(launches):
        fit = per_sm(a)
        out.append(dict(launch=a, per_sm=fit, waves=a.programs / (fit * sms) if fit else math.inf,
                        rf=min(a.programs, fit * sms) * program_regs(a) / (sms * REGS),
                        next=next_fits(a, launches[i + 1], sms) if i + 1 < len(launches) else None))
    return out


def print_tables(table: list[dict], sms: int) -> None:
    print(f"{len(table)} Triton launches a decode step on {sms} SMs")
    print(f"{'#':>3} {'kernel':<26} {'programs':>8} {'warps':>5} {'regs':>5} {'spill':>5} {'smem':>6} {'/SM':>4} "
          f"{'waves':>6} {'RF':>5} {'next fits':>9}")
    for i, r in enumerate(table):
        a = r["launch"]
        nxt = "" if r["next"] is None else f"{r['next']:.0%}"
        print(f"{i:>3} {a.name[:26]:<26} {a.programs:>8} {a.warps:>5} {a.regs:>5} {a.spills:>5} {a.smem:>6} "
              f"{r['per_sm']:>4} {r['waves']:>6.2f} {r['rf']:>5.0%} {nxt:>9}")
    print(f"\n{'kernel':<26} {'calls':>5} {'programs':>9} {'waves':>6} {'RF':>5} {'next fits':>9}  (means a call)")
    names = sorted({r["launch"].name for r in table})
    for name in names:
        mine = [r for r in table if r["launch"].name == name]
        nxt = [r["next"] for r in mine if r["next"] is not None]
        mean = lambda k: sum(r[k] for r in mine) / len(mine)  # noqa: E731
        print(f"{name[:26]:<26} {len(mine):>5} {sum(r['launch'].programs for r in mine) / len(mine):>9.0f} "
              f"{mean('waves'):>6.2f} {mean('rf'):>5.0%} {(sum(nxt) / len(nxt) if nxt else 1):>9.0%}")


def record_step(args) -> list[Launch]:
    """The Triton launches of one eager decode step at ``args.batch`` sequences."""
    import torch
    from triton.compiler.compiler import CompiledKernel

    from dayzero import LLM, SamplingParams

    seen: list[Launch] = []
    original = CompiledKernel.launch_metadata
    if not hasattr(CompiledKernel, "_init_handles"):
        raise SystemExit("this Triton's compiled kernels do not expose their handles: registers are unknown")

    def hook(self, grid, stream, *a):
        self._init_handles()  # loads the binary: registers and spills come from the driver
        g = tuple(grid) + (1,) * (3 - len(grid))
        seen.append(Launch(self.name, g[0] * g[1] * g[2], self.metadata.num_warps, self.n_regs,
                           self.metadata.shared, self.n_spills))
        return original(self, grid, stream, *a)

    llm = LLM(args.config, device="cuda", dtype=args.dtype, load_format="dummy", max_num_seqs=max(args.batch, 1),
              enforce_eager=True, max_model_len=args.prompt_len + 16)
    prompts = [{"prompt_token_ids": [1 + (i + j) % 1000 for j in range(args.prompt_len)]} for i in range(args.batch)]

    def launches(tokens: int) -> list[Launch]:
        seen.clear()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        return list(seen)

    CompiledKernel.launch_metadata = hook
    try:
        launches(3)  # compiles and measures what the step needs
        shorter, longer = launches(3), launches(4)
    finally:
        CompiledKernel.launch_metadata = original
    return longer[len(shorter):]  # the longer run's last decode step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: registers a thread are known only for compiled kernels")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print_tables(rows(record_step(args), sms), sms)


if __name__ == "__main__":
    main()
