"""bench/gpu_report.py, the per-family figures of bench/gpu.sh, on inputs whose answers are known: a metrics.jsonl
written here, a hand-made device trace, and a CPU torch.profiler trace of a small training step made here."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_report as gr

REPO = Path(__file__).resolve().parents[2]


def write_metrics(path: Path, step_times: list[float], t0: float = 1000.0, peak: bool = True) -> None:
    t = t0
    with open(path, "w") as f:
        for i, dt in enumerate(step_times, 1):
            t += dt
            rec = {"step": i, "time": t, "step_time": dt, "tokens": 1000, "tokens_per_s": 1000 / dt,
                   "mfu": 0.01 / dt, "loss": 10.0 - i * 0.1}
            if peak:
                rec["peak_mem_gib"] = 1.0 + i / 100
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps({"step": len(step_times), "val/loss": 1.0}) + "\n")  # a validation line: not a step


# (a kernel name as the profiler records it, or an operator of a CPU trace; its class). The first group comes from
# the first H200 trace; the Triton names are inductor's (triton_{red,per,poi,tem}_fused_<ops>_<n>); the norm kernels
# are torch's layer_norm_kernel.cu (layer norm, and RMSNorm through its rms_norm flag) and apex-style names.
NAMES = [
    ("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_splitK_NTN", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(cublasLt::cublasSplitKParams<float>)",
     "gemm"),  # the split-K GEMM's own epilogue, not a reduction of the model
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)", "attention"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>",
     "attention"),  # torch's varlen attention
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
     "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float>>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>", "reduction"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float>>>",
     "reduction"),  # a vector norm (the gradient clip), not a norm layer
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda"
     "(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>>", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>>",
     "copy"),
    ("void at::native::normal_kernel<float>(at::Tensor&)", "elementwise"),  # normal_, not a norm
    # Triton kernels of torch.compile: classed by what inductor generated, whatever it fused
    ("triton_per_fused_rms_norm_0", "triton_reduction"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "triton_reduction"),
    ("triton_poi_fused_add_mul_silu_2", "triton_pointwise"),
    ("triton_poi_fused__to_copy_3", "triton_pointwise"),
    ("triton_tem_fused_mm_4", "gemm"),
    # norms: RMSNorm through torch's fused kernels forward and backward, LayerNorm, apex
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>(int, float, "
     "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)", "norm"),
    ("void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<c10::BFloat16, float, true>",
     "norm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16, float, 32u, 16u, 32u, "
     "false, true, true>", "norm"),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float, float, true>", "norm"),
    ("void cuComputeGradGammaBeta<float, float, float>(float const*, float const*, int, int, int, float*, float*)",
     "norm"),
    ("void cuComputePartGradGammaBeta<c10::BFloat16, float, c10::BFloat16>", "norm"),
    ("aten::rms_norm", "norm"), ("aten::native_layer_norm_backward", "norm"), ("bioseq::rms_norm", "norm"),
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("aten::mul", "elementwise"), ("aten::sum", "reduction"),
    ("aten::linalg_vector_norm", "reduction"),
    ("aten::_foreach_add_", "optimizer"), ("aten::copy_", "copy"),
    ("a_kernel_no_rule_knows", "other"),
]


@pytest.mark.parametrize("name,cls", NAMES)
def test_kernel_class(name, cls):
    assert gr.kernel_class(name) == cls


def test_step_stats_leave_out_warmup_and_the_profiled_step(tmp_path):
    # 20 steps: 4 slow warm-up steps (the first fifth), 100 ms steps, a 1 s profiled step 10 and its 0.5 s
    # successor, a 300 ms stall at step 15
    times = [2.0, 1.0, 1.0, 1.0] + [0.1] * 16
    times[9], times[10], times[14] = 1.0, 0.5, 0.3
    write_metrics(tmp_path / "metrics.jsonl", times)
    recs = gr.load_metrics(tmp_path / "metrics.jsonl")
    assert len(recs) == 20  # the validation line is not a step
    st = gr.step_stats(recs, profiled={10})
    assert st["warmup"] == 5 and st["measured"] == 13 and (st["first_measured"], st["last_measured"]) == (6, 20)
    assert st["step_ms"]["p50"] == pytest.approx(100) and st["step_ms"]["max"] == pytest.approx(300)
    assert st["step_ms"]["max_over_median"] == pytest.approx(3.0)
    assert st["step_ms"]["p90"] == pytest.approx(100)  # one stall in 13 steps sits above the 90th percentile
    assert st["tokens_per_s"] == pytest.approx(10000) and st["mfu"] == pytest.approx(0.1)
    assert st["peak_mem_gib"] == pytest.approx(1.2)  # over every step, warm-up included
    # the window spans the measured steps: from the start of step 6 to the end of step 20
    assert st["window"] == (pytest.approx(1000 + sum(times[:5])), pytest.approx(1000 + sum(times)))
    assert gr.step_stats(recs)["step_ms"]["max"] == pytest.approx(1000)  # unprofiled: step 10 counts


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    for q in (0, 10, 50, 90, 100):
        assert gr.percentile(xs, q) == pytest.approx(float(torch.quantile(torch.tensor(xs), q / 100)))


def test_util_stats_use_the_measured_window():
    samples = [(t, 0.0 if t < 5 else 80.0) for t in range(10)] + [(20, 0.0)]
    u = gr.util_stats(samples, (5, 9))
    assert u == {"n": 5, "mean": 80.0, "median": 80.0, "zero_share": 0.0}
    assert gr.util_stats(samples, (100, 200)) is None
    assert gr.util_stats(samples, None)["zero_share"] == pytest.approx(6 / 11)


def test_device_trace_breakdown_and_idle():
    # a 10 ms step: 3 ms GEMM, 1 ms attention, 1 ms elementwise overlapping the GEMM by 0.5 ms (another stream),
    # 0.5 ms memcpy, 1 ms NCCL; busy = union = 3 + 1 + 0.5 + 0.5 + 1 = 6 ms -> idle 4 ms
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10_000, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 1000, "dur": 3000},
          {"ph": "X", "cat": "kernel", "name": "void elementwise_kernel<add>", "ts": 3500, "dur": 1000},
          {"ph": "X", "cat": "kernel", "name": "flash_bwd", "ts": 5000, "dur": 1000},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 6500, "dur": 500},
          {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 8000, "dur": 1000},
          {"ph": "i", "cat": "instant", "name": "marker", "ts": 50_000}]  # not a complete event
    kb = gr.kernel_breakdown([e for e in ev if e["ph"] == "X"])
    assert kb["device"] == "cuda" and kb["wall_ms"] == pytest.approx(10)
    assert kb["idle_ms"] == pytest.approx(4.0)
    assert kb["ms"] == pytest.approx({"gemm": 3, "attention": 1, "norm": 0, "triton_reduction": 0,
                                      "triton_pointwise": 0, "reduction": 0, "elementwise": 1, "optimizer": 0,
                                      "communication": 1, "copy": 0.5, "other": 0})
    assert (kb["kernels"], kb["copies"]) == (4, 1)


def test_kernels_launched_and_host_time():
    """Host time = the union of the host's operators and runtime calls over its threads, less the calls that wait for
    the device; launches are counted on the host (a CUDA graph launch is one call for many kernels)."""
    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    ev = [x("cpu_op", "aten::linear", 0, 3000), x("cpu_op", "aten::mm", 500, 1000),  # nested: counted once
          x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 2000, 4000, tid=2),  # the autograd thread
          x("cpu_op", "aten::item", 7000, 2000),
          x("cuda_runtime", "cudaLaunchKernel", 600, 10), x("cuda_runtime", "cudaLaunchKernel", 2100, 10, tid=2),
          x("cuda_driver", "cuLaunchKernel", 2200, 10, tid=2),  # a Triton kernel's launch
          x("cuda_runtime", "cudaGraphLaunch", 2300, 20, tid=2),
          x("cuda_runtime", "cudaMemcpyAsync", 7100, 50), x("cuda_runtime", "cudaStreamSynchronize", 7200, 1500),
          x("cuda_runtime", "cudaEventRecord", 8800, 5),
          # between 6000 and 7000 no host thread runs anything (the loader, Python): neither host nor wait
          x("kernel", "nvjet_sm90_gemm", 700, 2000), x("kernel", "triton_poi_fused_add_0", 2300, 100),
          x("kernel", "triton_red_fused_sum_1", 2500, 100), x("kernel", "triton_poi_fused_mul_2", 2700, 100),
          x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 8650, 30)]
    kb = gr.kernel_breakdown(ev)
    assert kb["kernels"] == 4 and kb["copies"] == 1
    assert kb["launch_calls"] == 4  # 2 cudaLaunchKernel, 1 cuLaunchKernel, 1 cudaGraphLaunch
    assert kb["syncs"] == 1 and kb["wait_ms"] == pytest.approx(1.5)
    # host union: [0, 6000] (main 0-3000, autograd 2000-6000) + [7000, 9000] = 8 ms, less 1.5 ms of waiting
    assert kb["host_ms"] == pytest.approx(6.5)
    assert kb["ms"]["triton_pointwise"] == pytest.approx(0.2) and kb["ms"]["triton_reduction"] == pytest.approx(0.1)


def test_cpu_profiler_trace_of_a_training_step(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(128, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    trace = tmp_path / "trace_steps_3-3.json"
    prof.export_chrome_trace(str(trace))
    kb = gr.kernel_breakdown(gr.load_trace(trace))
    assert kb["device"] == "cpu" and kb["wall_ms"] > 0
    for cls in ("gemm", "elementwise", "reduction", "optimizer"):
        assert kb["ms"][cls] > 0, (cls, kb)
    assert kb["kernels"] == 0 and kb["syncs"] == 0 and 0 < kb["host_ms"] <= kb["wall_ms"]
    # self times of nested operators never count twice: with idle they fill the window (operators on two threads
    # can overlap, hence the slack)
    assert 0 <= kb["idle_ms"] <= kb["wall_ms"]
    assert sum(kb["ms"].values()) <= 1.05 * kb["wall_ms"]


def test_family_cli_prints_every_figure(tmp_path):
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    write_metrics(run / "metrics.jsonl", [0.5] * 5 + [0.1] * 15)
    ev = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 2000},
          {"ph": "X", "cat": "kernel", "name": "reduce_kernel", "ts": 8000, "dur": 2000},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 7000, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 5, "pid": 1, "tid": 1}]
    (run / "profile" / "trace_steps_12-12.json").write_text(json.dumps({"traceEvents": ev}))
    (tmp_path / "util.csv").write_text("1001.0,0\n1003.0,50\n1003.5,70\nnot,a sample\n1004.0,[N/A]\n")  # 1001: warm-up
    (tmp_path / "train.log").write_text("[2026-12-08 10:00:00] [INFO] starting\n"
                                        "resolved: layout=packed attention=torch_varlen norm=fused moe=none "
                                        "compile=none cuda_graphs=false microbatch=131072 grad_accum_steps=1\n"
                                        "step 10/100 | loss 3.1\n")
    r = subprocess.run([sys.executable, "bench/gpu_report.py", "family", "--name", "Toy 1M", "--run", str(run),
                        "--util", str(tmp_path / "util.csv"), "--log", str(tmp_path / "train.log"),
                        "--launched", "990", "--json", str(tmp_path / "r.json")],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "measured 13 (steps 6-20" in out and "profiled step(s) 12-12" in out
    assert "tokens/s (median) 10000" in out and "MFU (median) 10.0%" in out and "peak GPU memory 1.20 GiB" in out
    assert "p50 100 ms | p90 100 ms | max 100 ms | max/median 1.00" in out
    assert "first step (step 1): 0.5 s, ended 10.5 s after the launch" in out  # step 1 ended at 1000.5
    assert "mean 60% | median 60% | samples at 0%: 0% (n 2)" in out
    assert "gemm 20.0%" in out and "reduction 20.0%" in out and "idle 60.0%" in out
    assert "per step: 2 kernels (1 launch calls, 0 copies/memsets) | host 7 ms of 10 ms wall" in out
    assert "resolved: layout=packed attention=torch_varlen norm=fused" in out
    assert out.splitlines()[-1].startswith("RESULT GPU_FAMILY Toy_1M tokens_per_s=10000 ")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["profile"]["idle_ms"] == pytest.approx(6.0)
    assert rep["profile"]["per_step"]["kernels"] == 2 and rep["profile"]["per_step"]["host_ms"] == pytest.approx(7)
    assert rep["resolved"] == {"layout": "packed", "attention": "torch_varlen", "norm": "fused", "moe": "none",
                               "compile": "none", "cuda_graphs": "false", "microbatch": "131072",
                               "grad_accum_steps": "1"}
    assert rep["first_step"] == {"step": 1, "s": 0.5, "end": pytest.approx(1000.5),
                                 "after_launch_s": pytest.approx(10.5)}
    # without the log: no resolved line, said so
    r = subprocess.run([sys.executable, "bench/gpu_report.py", "family", "--name", "Toy 1M", "--run", str(run)],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "resolved: (the training printed no 'resolved:' line)" in r.stdout


def test_resolved_line_and_compile_notes():
    assert gr.parse_resolved("a\nresolved: layout=padded attention=sdpa\nresolved: layout=x\n") == {
        "layout": "padded", "attention": "sdpa"}  # the first line
    assert gr.parse_resolved("[rank0]: resolved: norm=plain compile=blocks") == {"norm": "plain",
                                                                                  "compile": "blocks"}
    assert gr.parse_resolved("dry run: resolved without starting anything\nnothing resolved: here") is None
    log = ("V1208 torch/_dynamo/guards.py] [0/1] [__recompiles] Recompiling function forward in blocks.py:12\n"
           "V1208 [0/2] [__recompiles] Recompiling function forward in blocks.py:12\n"
           "V1208 [__graph_breaks] Graph break in user code at eco_rna.py:480\n"
           "W1208 torch._dynamo hit config.recompile_limit (8)\n")
    assert gr.compile_notes(log) == {"recompiles": 2, "graph_breaks": 1, "limit_hit": True}
    assert gr.compile_notes("step 1\n") == {"recompiles": 0, "graph_breaks": 0, "limit_hit": False}


@pytest.mark.parametrize("case", ["no metrics", "bad json", "no steps"])
def test_bad_input_is_one_line_and_nonzero(tmp_path, case):
    run = tmp_path / "run"
    run.mkdir()
    if case == "bad json":
        (run / "metrics.jsonl").write_text('{oops\n{"step": 1, "step_time": 0.1, "tokens_per_s": 10}\n')
    elif case == "no steps":
        (run / "metrics.jsonl").write_text('{"val/loss": 1.0}\n')
    r = subprocess.run([sys.executable, "bench/gpu_report.py", "family", "--name", "x", "--run", str(run)],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_report: "), r.stderr


def test_a_last_line_cut_by_a_kill_is_left_out(tmp_path):
    """A run killed while writing its last metrics line (SIGKILL after the stage's timeout) is reported from its
    complete lines; a broken line elsewhere is an error (the test above)."""
    write_metrics(tmp_path / "metrics.jsonl", [0.1] * 6)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "time": 10')
    assert [r["step"] for r in gr.load_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_sample_util_fake_writes_stamped_samples_until_terminated(tmp_path):
    out = tmp_path / "u.csv"
    p = subprocess.Popen([sys.executable, "bench/gpu_report.py", "sample-util", "--out", str(out), "--fake",
                          "--interval-ms", "20"], cwd=REPO)
    try:
        import time
        deadline = time.time() + 20
        while time.time() < deadline and len(out.read_text().splitlines() if out.exists() else []) < 3:
            time.sleep(0.05)
    finally:
        p.terminate()
    assert p.wait(timeout=10) == 0
    samples = gr.load_util(out)
    assert len(samples) >= 3 and all(u == 0 for _, u in samples)
    assert all(b[0] >= a[0] for a, b in zip(samples, samples[1:]))
