"""bench/run_all.py: RESULT collection, target marking, failure reporting, against fake benchmark scripts."""
import textwrap

from bench import run_all


def fake(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text("import sys\n" + textwrap.dedent(body))
    return str(path)


def test_parse_result_line():
    f = run_all.parse_result_line("RESULT P4 1.07 engine / plain step time, target <= 1.15\n", "engine")
    assert (f.id, f.value, f.description) == ("P4", 1.07, "engine / plain step time, target <= 1.15")
    assert run_all.parse_result_line("step 3 | loss 2.0", "engine") is None
    assert "not a number" in run_all.parse_result_line("RESULT P4 fast engine", "engine")
    assert "not finite" in run_all.parse_result_line("RESULT P4 nan engine", "engine")
    assert "malformed" in run_all.parse_result_line("RESULT", "engine")


def test_targets():
    assert run_all.check_target("P1", 1.10) == "ok" and run_all.check_target("P1", 1.2) == "MISS"
    assert run_all.check_target("P1.waste", 0.0) == "ok" and run_all.check_target("P1.waste", 3.0) == "MISS"
    assert run_all.check_target("P3", 0.5) == "ok" and run_all.check_target("P3", 0.49) == "MISS"
    assert run_all.check_target("P3uc", 0.5) == "ok" and run_all.check_target("P3uc", 0.06) == "MISS"
    assert run_all.check_target("P3uc.rss10", 1.2) == "ok" and run_all.check_target("P3uc.rss10", 3.5) == "MISS"
    assert run_all.check_target("P3j2", 1.7) == "ok" and run_all.check_target("P3j2", 1.5) == "MISS"
    assert run_all.check_target("P2", 0.01) == "-"  # reported without a target (run_all.TARGETS says why)
    assert run_all.check_target("P6.dynamic", 9.0) == "-"  # per-setup lines carry no target of their own


def test_collects_figures_and_reports_failures(tmp_path, capsys):
    good = fake(tmp_path, "good", """
        assert sys.argv[1:] == ["--quick"], sys.argv
        print("warming up")
        print("RESULT P4 1.30 engine step / plain step, target <= 1.15")
        print("RESULT scaling 1.8 tokens/s ws2 / ws1")
        """)
    crash = fake(tmp_path, "crash", """
        print("RESULT P3 0.9 data_prep / gzip -dc")
        sys.exit(3)
        """)
    silent = fake(tmp_path, "silent", "print('no figures here')\n")
    partial = fake(tmp_path, "partial", "print('RESULT P1 1.01 wavefront / uniform')\n")
    benches = [("good", good, ("P4", "scaling")), ("crash", crash, ("P3",)), ("silent", silent, ("P6",)),
               ("partial", partial, ("P1", "P1.waste")), ("gone", str(tmp_path / "missing.py"), ("P2",))]
    rc = run_all.main([], benches=benches)
    out, err = capsys.readouterr()
    assert rc == 1
    assert "[good] warming up" in out  # streamed, prefixed
    table = out[out.index("figure"):]
    p4 = next(ln for ln in table.splitlines() if ln.startswith("P4 "))
    assert "1.3" in p4 and "<= 1.15" in p4 and "MISS" in p4
    assert "ok" in next(ln for ln in table.splitlines() if ln.startswith("P3 "))
    assert "NONE" in next(ln for ln in table.splitlines() if ln.startswith("P1.waste"))
    assert "figures missing their target: P4" in out
    assert "FAILED good" not in err
    assert "FAILED crash" in err and "exited with status 3" in err
    assert "FAILED silent" in err and "printed no RESULT line" in err
    assert "FAILED partial" in err and "no RESULT line for P1.waste" in err
    assert "FAILED gone" in err and "not found" in err
    assert "total" in out


def test_all_passing_exits_zero_and_timeout_kills(tmp_path, capsys):
    ok = fake(tmp_path, "ok", "print('RESULT P1.waste 0 wasted row-iterations')\n")
    assert run_all.main(["--full"], benches=[("ok", ok, ("P1.waste",))]) == 0
    hang = fake(tmp_path, "hang", "import time\nprint('RESULT P1 1.0 x', flush=True)\ntime.sleep(60)\n")
    assert run_all.main(["--timeout", "2"], benches=[("hang", hang, ("P1",))]) == 1
    assert "killed after the 2 s timeout" in capsys.readouterr().err
