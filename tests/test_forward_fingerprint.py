"""Forward fingerprints (engine/fingerprint.py) and how the controller compares them
(runtime/forwards.py, Components.compare_forwards): the fields a component's bits depend on, the
differences named field by field, and the policy at start, on a join and after a restart.
Runs with a replica forced onto the eager path (which differs in path, build and probe) are in
test_run_mixed_forward.py."""

import dataclasses
import json
import platform

import pytest
import torch

from lockstep.config import ConfigError, load
from lockstep.config.load import rescale
from lockstep.engine.types import ForwardFingerprint
from lockstep.runtime import forwards

FUSED = ForwardFingerprint(path="fused", kernel_build="7db330cd604e3d34", device="cpu (x86_64, GenuineIntel)",
                           dtype="float32", isa=("avx", "avx2", "avx512bw", "avx512f", "fma", "sse4_2"),
                           aten_cpu="AVX512", mkl="2024.2 (build 20240605), CNR strict, branch AVX512",
                           matmul_precision="highest", libraries="torch 2.13.0+cpu, glibc 2.36",
                           probe="1c7ce153ac3e4b52")
EAGER = dataclasses.replace(FUSED, path="eager", kernel_build="", probe="5a259621098cd492")


def test_differences_name_each_field_with_both_values():
    assert FUSED.differences(FUSED) == ()
    assert EAGER.differences(FUSED) == ("path 'eager' vs 'fused'", "kernel_build '' vs '7db330cd604e3d34'",
                                        "probe '5a259621098cd492' vs '1c7ce153ac3e4b52'")
    # the flags only one side has, not both lists
    avx2 = dataclasses.replace(FUSED, isa=("avx", "avx2", "fma", "sse4_2"))
    assert avx2.differences(FUSED) == ("isa '' vs 'avx512bw avx512f'",)
    amd = dataclasses.replace(FUSED, isa=("avx", "avx2", "fma", "fma4", "sse4_2"))
    assert amd.differences(FUSED) == ("isa 'fma4' vs 'avx512bw avx512f'",)
    for f in dataclasses.fields(ForwardFingerprint):  # every field counts, alone
        other = dataclasses.replace(FUSED, **{f.name: ("x",) if f.name == "isa" else "x"})
        (d,) = other.differences(FUSED)
        assert d.startswith(f"{f.name} "), d


def fp_stats():
    return {"trainer": {"forward": FUSED, "rank_forwards": (FUSED, dataclasses.replace(FUSED, dtype="bfloat16"))},
            "generator": {"forward": FUSED}, "generator1": {"forward": EAGER}, "env0": {"busy_s": 0.0}}


def test_a_refusal_names_the_component_the_field_and_both_values():
    got = forwards.reported(fp_stats())
    assert set(got) == {"trainer", "trainer rank 1", "trainer rank 2", "generator", "generator1"}  # env workers: none
    diffs = forwards.differing(got)
    assert set(diffs) == {"trainer rank 2", "generator1"}
    msg = str(forwards.refusal(diffs))
    assert ("generator1 would compute other bits than the trainer: path 'eager' vs 'fused', "
            "kernel_build '' vs '7db330cd604e3d34', probe '5a259621098cd492' vs '1c7ce153ac3e4b52'") in msg
    assert "trainer rank 2 would compute other bits than the trainer: dtype 'bfloat16' vs 'float32'" in msg
    assert "set runtime.allow_mixed_forward = true" in msg and "docs/deploy.md" in msg
    assert isinstance(forwards.refusal(diffs), ConfigError)  # the CLI prints it as an error, exit 2
    report = json.loads(json.dumps(forwards.report(got)))  # forward.json
    assert report["differences"]["generator1"][0] == "path 'eager' vs 'fused'"
    assert report["components"]["generator1"]["path"] == "eager"


@pytest.fixture
def components():
    """Components over a fleet of two replicas; compare_forwards reads only names and the router."""
    from lockstep.runtime.controller import Components
    from lockstep.runtime.fleet import GeneratorFleet

    fleet = GeneratorFleet(["handle0", "handle1"], timeout=30)
    yield Components(trainer="trainer-handle", fleet=fleet, envs=[], timeout=30)
    fleet.close()


def test_a_run_whose_components_differ_is_refused_at_start(components):
    with pytest.raises(forwards.MixedForward, match="generator1 would compute other bits than the trainer: path"):
        components.compare_forwards(fp_stats(), start=True)
    ok = {"trainer": {"forward": FUSED}, "generator": {"forward": FUSED}, "generator1": {"forward": FUSED}}
    assert components.compare_forwards(ok, start=True) == []  # the control: equal forwards start
    assert components.stats["runtime/mixed_forward"] == 0


def test_the_opt_in_runs_with_every_component_and_counts_them(components, caplog):
    components.allow_mixed_forward = True
    with caplog.at_level("WARNING", logger="lockstep.run"):
        assert components.compare_forwards(fp_stats(), start=True) == []
    assert components.stats["runtime/mixed_forward"] == 2
    assert "runtime.allow_mixed_forward = true, running with: " in caplog.text and "path 'eager' vs 'fused'" in caplog.text
    # counted as they take part: a replica that joins differing, then those a new trainer differs from
    assert components.compare_forwards({"generator2": {"forward": EAGER}}) == []
    assert components.stats["runtime/mixed_forward"] == 3
    assert components.compare_forwards({"trainer": {"forward": EAGER, "rank_forwards": (EAGER, EAGER)}}) == []
    assert components.stats["runtime/mixed_forward"] == 4  # "generator" (the eager replicas now match)


def test_a_replica_that_joins_or_restarts_differing_is_kept_out(components, caplog):
    c = components
    same = {"trainer": {"forward": FUSED}, "generator": {"forward": FUSED}, "generator1": {"forward": FUSED}}
    c.compare_forwards(same, start=True)
    with caplog.at_level("WARNING", logger="lockstep.run"):  # the allocator's new replica
        assert c.compare_forwards({"generator2": {"forward": EAGER}}) == ["generator2"]
    assert "generator2 is kept out of the run: generator2 would compute other bits than the trainer: path" in caplog.text
    assert "generator2" not in c.forwards and c.stats["runtime/forward_refused"] == 1
    assert c.compare_forwards({"generator2": {"forward": FUSED}}) == []  # a matching one joins
    # a replica Ray restarted elsewhere: dropped while another is left...
    assert c.compare_forwards({"generator1": {"forward": EAGER}}) == ["generator1"]
    c.fleet.router.drop(1)
    # ... but the last one differing ends the run, as does a trainer rank
    with pytest.raises(forwards.MixedForward, match="generator would compute other bits"):
        c.compare_forwards({"generator": {"forward": EAGER}})
    c.forwards["generator"] = FUSED
    with pytest.raises(forwards.MixedForward, match="trainer rank 1 would compute other bits"):
        c.compare_forwards({"trainer": {"forward": FUSED, "rank_forwards": (EAGER,)}})


def test_a_restarted_trainer_is_compared_with_every_replica(components):
    c = components
    c.compare_forwards({"trainer": {"forward": FUSED}, "generator": {"forward": FUSED},
                        "generator1": {"forward": FUSED}}, start=True)
    with pytest.raises(forwards.MixedForward) as e:  # the new trainer is eager: no replica computes its bits
        c.compare_forwards({"trainer": {"forward": EAGER}})
    assert "generator would compute other bits than the trainer: path 'fused' vs 'eager'" in str(e.value)
    assert "generator1 would compute" in str(e.value)


def test_the_opt_in_is_a_checked_config_switch():
    assert load(None, []).runtime.allow_mixed_forward is False
    assert load(None, ["runtime.allow_mixed_forward=true"]).runtime.allow_mixed_forward is True
    with pytest.raises(ConfigError, match="runtime.allow_mixed_forward: expected bool, got int 1"):
        load(None, ["runtime.allow_mixed_forward=1"])
    # a run resumed on other nodes may need it (the refusal's advice must work with --resume)
    assert rescale(load(None, []), ["runtime.allow_mixed_forward=true"]).runtime.allow_mixed_forward is True


def test_only_the_flags_that_change_results_are_kept():
    from lockstep.engine.fingerprint import cpu_isa

    x86 = "processor : 0\nflags\t\t: fpu sse4_2 avx aes avx2 bmi2 fma avx512f avx512_bf16 popcnt amx_tile\n"
    assert cpu_isa(x86) == ("amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "fma", "sse4_2")
    arm = "processor : 0\nFeatures\t: fp asimd evtstrm aes crc32 sve bf16\n"
    assert cpu_isa(arm) == ("asimd", "bf16", "sve")
    assert cpu_isa("") == ()


def test_the_fingerprint_is_the_forward_this_process_runs(builtin_dir):
    from lockstep.engine import kernels
    from lockstep.engine.fingerprint import RESULT_ISA, forward_fingerprint, probe
    from lockstep.engine.trainer import Trainer

    trainer = Trainer.from_pretrained(builtin_dir)
    fp = forward_fingerprint(trainer.model)
    assert fp.path == trainer.model.path and fp.dtype == "float32"
    assert fp.kernel_build == (kernels.tag() if fp.path == "fused" else "")
    assert fp.device.startswith(f"cpu ({platform.machine()}")
    assert fp.aten_cpu == torch.backends.cpu.get_cpu_capability()
    assert set(fp.isa) <= RESULT_ISA
    if torch.backends.mkl.is_available():
        assert "CNR strict" in fp.mkl
    # The probe is the bits of the forward: another load of the same weights gives the same, a
    # weight one ulp away other ones.
    assert forward_fingerprint(Trainer.from_pretrained(builtin_dir).model) == fp
    with torch.no_grad():
        w = trainer.model.lm_head.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    assert probe(trainer.model) != fp.probe



def test_the_triton_path_names_its_libraries(tmp_path):
    """The CUDA path's fingerprint, on CPU tensors under Triton's interpreter (conftest.py): the
    Triton kernels are another path, with other bits than the fused ones, and other libraries."""
    import triton

    from lockstep.engine.device import Compute
    from lockstep.engine.fingerprint import forward_fingerprint
    from lockstep.engine.tiny import save_model_dir, tiny_config
    from lockstep.engine.trainer import Trainer

    micro = str(save_model_dir(tmp_path, tiny_config(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                     intermediate_size=64), seed=3))
    on = forward_fingerprint(Trainer.from_pretrained(micro, compute=Compute("cpu", kernels="triton")).model)
    fused = forward_fingerprint(Trainer.from_pretrained(micro).model)
    assert on.path == "triton" and on.kernel_build == ""
    assert on.libraries.endswith(f", triton {triton.__version__}, cuda {torch.version.cuda}")
    assert [d.split(" ")[0] for d in on.differences(fused)] == ["path", "kernel_build", "libraries", "probe"]
