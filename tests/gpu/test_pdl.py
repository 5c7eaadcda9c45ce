"""Programmatic dependent launch (common.cuh): no kernel touches global memory before it waits for the kernel
before it on the stream.

The source puts the wait first (tests/test_cuda_ops.py checks that), but ptxas schedules the machine code: it moved
gemv's non-coherent (__ldg) loads of x above griddepcontrol.wait, so gemv read x before the previous kernel had
written it (decode logits off by 140%). So this reads the SASS of every kernel: nothing global before the first
ACQBULK (griddepcontrol.wait), except gemv's weight loads (LDG ... .NA ... CONSTANT: L1::no_allocate, read-only),
which no kernel writes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GLOBAL_OPS = {"LD", "ST", "LDG", "STG", "ATOM", "ATOMG", "RED", "REDG", "LDGSTS", "UTMALDG", "UBLKCP"}
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)")


def find_cuobjdump() -> str | None:
    return shutil.which("cuobjdump") or next(
        (str(p) for p in [Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "bin" / "cuobjdump"]
         if p.is_file()), None)


def functions(sass: str) -> dict[str, list[tuple[str, str]]]:
    """{function name: [(opcode, modifiers), ...]} in program order."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in sass.splitlines():
        header = re.match(r"\s*Function : (\S+)", line)
        if header:
            current = out.setdefault(header.group(1), [])
        elif current is not None and (m := INSTRUCTION.search(line)):
            current.append((m.group(1), m.group(2)))
    return out


def global_accesses_before_wait(instructions: list[tuple[str, str]]) -> tuple[bool, list[str]]:
    """Whether the function waits at all, and the global accesses it issues before its first wait."""
    before = []
    for opcode, modifiers in instructions:
        if opcode == "ACQBULK":
            return True, before
        if opcode in GLOBAL_OPS:
            before.append(opcode + modifiers)
    return False, before


def is_weight_load(op: str) -> bool:
    return op.startswith("LDG") and ".NA" in op and "CONSTANT" in op


def is_read_only_load(op: str) -> bool:
    """A non-coherent load (a const __restrict__ pointer): the FP8 GEMV's weight scales before its wait. x, which the
    previous kernel writes, is read with plain loads (gemv_tile.cuh load_coherent), so it never shows as one."""
    return op.startswith("LDG") and "CONSTANT" in op


def machine_code(device, tmp_path: Path) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{kernel file: {function: instructions}} of every kernel as built for this GPU."""
    from tinyvllm.backends.cuda.kernel_cache import build_cubins, compile_jobs

    if device.compute_capability < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump (CUDA toolkit) not found")
    out: dict[str, dict[str, list[tuple[str, str]]]] = {}
    jobs = compile_jobs()  # a job per kernel of the split files: their functions are gathered by file
    cubins = build_cubins(jobs, device.arch)
    for job in jobs:
        path = tmp_path / f"{job.name}.cubin"
        path.write_bytes(cubins[job.name])
        sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
        out.setdefault(job.file, {}).update(functions(sass))
    return out


def test_no_kernel_touches_global_memory_before_it_waits(device, tmp_path):
    checked, wrong = 0, []
    for file, kernels in machine_code(device, tmp_path).items():
        for name, instructions in kernels.items():
            waits, before = global_accesses_before_wait(instructions)
            if name.startswith("gemv"):  # its weights, and (e4m3) their scales: read-only data no kernel writes
                before = [op for op in before if not is_weight_load(op) and not is_read_only_load(op)]
            if not waits or before:
                wrong.append(f"{file}.cu {name}: " + (f"{before} before its wait" if waits else "never waits"))
            checked += 1
    assert not wrong, wrong
    assert checked >= 30  # every kernel of cuda/*.cu, template instances included


def test_gemv_has_its_first_iteration_of_weights_in_flight_before_it_waits(device, tmp_path):
    """All 2 * GEMV_UNROLL weight loads of a warp's first iteration go out before the wait, so that they overlap
    the previous kernel: with the wait inside the loop ptxas issued 2 of them there, the rest after it."""
    from tinyvllm.backends.cuda.ops import GEMV_UNROLL

    code = machine_code(device, tmp_path)
    kernels = {**code["gemv"], **{name: sass for name, sass in code["fp8"].items() if name.startswith("gemv")}}
    forms = ("", "_pipelined")
    kinds = ("bf16", "f32", "swiglu_bf16", "geglu_bf16", "fp8_bf16", "fp8_f32", "swiglu_fp8", "geglu_fp8",
             "fp8_block_bf16", "fp8_block_f32")
    assert set(kernels) == {f"gemv_{kind}{form}" for kind in kinds for form in forms}
    for name, instructions in kernels.items():
        _, before = global_accesses_before_wait(instructions)
        assert sum(map(is_weight_load, before)) == 2 * GEMV_UNROLL, (name, before)


def before_main_wait(instructions: list[tuple[str, str]]) -> list[str]:
    """The global accesses before a function's last wait in program order: a kernel whose spare warps wait and exit
    early has its main path's wait last (the first one is theirs)."""
    waits = [i for i, (opcode, _) in enumerate(instructions) if opcode == "ACQBULK"]
    return [op + mods for op, mods in instructions[:waits[-1]] if op in GLOBAL_OPS] if waits else []


def test_gemv_chain_copies_its_first_stages_before_it_waits(device, tmp_path):
    """gemv_chain's ring gets its first CHAIN_STAGES - 1 stages of weights by cp.async before the wait, so that they
    overlap the previous kernel (loads into registers there were moved below the wait by ptxas), and nothing else
    global goes first on that path."""
    from tinyvllm.backends.cuda.ops import CHAIN8_STAGES, CHAIN_K, CHAIN_STAGES

    kernels = machine_code(device, tmp_path)["gemv_chain"]
    assert set(kernels) == {"gemv_chain_bf16", "gemv_chain_f32", "gemv_swiglu_chain", "gemv_geglu_chain",
                            "gemv_chain8_bf16", "gemv_chain8_f32"}
    for name, instructions in kernels.items():
        tile = 8 if name.startswith("gemv_chain8") else 16
        pieces = tile * CHAIN_K // 8 // 32  # a lane's 16-byte chunks of a stage of the tile's rows
        stages = CHAIN8_STAGES if tile == 8 else CHAIN_STAGES
        before = before_main_wait(instructions)
        assert len(before) == (stages - 1) * pieces and all(op.startswith("LDGSTS") for op in before), name


def test_the_invariant_merge_has_its_first_chunk_states_in_flight_before_it_folds(device, tmp_path):
    """attention_combine_inv issues the loads of its first COMBINE_UNROLL chunk states (m and l, the output entry)
    together after the wait, before the fold's first exponential: a load behind each fold (as its loop once
    compiled) makes a round trip to L2 per chunk, at batch 1 on the critical path."""
    source = (Path(__file__).resolve().parents[2] / "cuda" / "attention_decode.cu").read_text()
    unroll = int(re.search(r"constexpr int COMBINE_UNROLL = (\d+);", source).group(1))
    instructions = machine_code(device, tmp_path)["attention_decode"]["attention_combine_inv"]
    waited = [opcode for opcode, _ in instructions].index("ACQBULK")
    first_exp = next(i for i, (opcode, _) in enumerate(instructions) if opcode == "MUFU" and i > waited)
    loads = [op for op, _ in instructions[waited:first_exp] if op == "LDG"]
    assert len(loads) >= 2 * unroll, instructions[waited:first_exp]


def test_the_check_sees_a_hoisted_load():
    """The parser on a made-up listing: a load above ACQBULK is found, one below is not."""
    sass = """
        Function : k
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 LDG.E.128.CONSTANT R4, desc[UR6][R2.64] ;
        /*0020*/                   ACQBULK ;
        /*0030*/                   STG.E desc[UR6][R2.64], R4 ;
    """
    [(name, instructions)] = functions(sass).items()
    assert name == "k"
    assert global_accesses_before_wait(instructions) == (True, ["LDG.E.128.CONSTANT"])


def test_accesses_are_listed_before_the_main_paths_wait():
    """A spare warp's early wait comes first in program order; the accesses listed are those before the last one."""
    sass = """
        Function : k
        /*0000*/              @!P0 BRA `(.L_x_1) ;
        /*0010*/                   ACQBULK ;
        /*0020*/                   EXIT ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64], !P0 ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R3+0x220], desc[UR6][R6.64], !P0 ;
        /*0050*/                   ACQBULK ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R3+0x440], desc[UR6][R8.64], !P0 ;
    """
    [(name, instructions)] = functions(sass).items()
    assert before_main_wait(instructions) == ["LDGSTS.E.BYPASS.128"] * 2
    assert before_main_wait(instructions[:3]) == []
