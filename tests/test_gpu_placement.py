"""model.device / model.dtype, GPU placement and the errors on a machine without a GPU.

The CUDA path's arithmetic is tested under Triton's interpreter (test_triton_kernels.py,
test_triton_path.py); here: the settings, what `--dry-run` shows, and that asking for a GPU where
there is none (or no Triton) is a clear error at start, never a silent fall back to the CPU.
"""

import importlib.util
import json

import pytest

from lockstep.config import ConfigError, load
from lockstep.runtime.plan import gpu_shares, make_plan, visible_gpus


def test_device_and_dtype_settings_are_checked():
    with pytest.raises(ConfigError, match="model.device: expected 'cpu' or 'cuda', got 'gpu'"):
        load(None, ["model.device='gpu'"])
    with pytest.raises(ConfigError, match="model.dtype: expected 'float32' or 'bfloat16', got 'float16'"):
        load(None, ["model.dtype='float16'"])
    with pytest.raises(ConfigError, match="bfloat16 needs model.device = 'cuda'"):
        load(None, ["model.dtype='bfloat16'"])
    assert load(None, ["model.device='cuda'", "model.dtype='bfloat16'"]).model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="speculative decoding runs on the CPU path only"):
        load(None, ["model.device='cuda'", "rollout.speculative.drafter='suffix'"])
    with pytest.raises(ConfigError, match=r"runtime.gpus: expected an integer >= 0, or -1"):
        load(None, ["runtime.gpus=-2"])


@pytest.mark.parametrize("listed, count", [("0,1", 2), ("", 0), ("-1", 0), ("2,-1,3", 1), ("GPU-8f3c", 1)])
def test_visible_gpus_follow_cuda_visible_devices(monkeypatch, listed, count):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert visible_gpus() == count


def test_gpu_shares_pack_onto_the_gpus_there_are():
    assert gpu_shares(2, 1, 1) == (1.0, 1.0)  # a GPU each
    assert gpu_shares(1, 1, 1) == (0.5, 0.5)  # trainer and generator share one
    assert gpu_shares(3, 1, 3) == (0.5, 0.5)  # 4 processes on 3 GPUs: halves (0.75 would strand one)
    assert gpu_shares(8, 2, 4) == (1.0, 1.0)
    with pytest.raises(ConfigError, match="train.replicas = 2 on GPUs needs a GPU for each trainer replica"):
        gpu_shares(2, 2, 1)
    with pytest.raises(ConfigError, match="model.device = 'cuda' but no GPU is visible here"):
        gpu_shares(0, 1, 1)


def test_dry_run_shows_the_gpu_placement(capsys):
    from lockstep.cli import main

    assert main(["run", "--dry-run", "model.device='cuda'", "model.dtype='bfloat16'", "runtime.gpus=2",
                 "rollout.replicas=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert (plan["device"], plan["num_gpus"], plan["trainer_gpus"], plan["generator_gpus"]) == ("cuda", 2, 1.0, 1.0)
    assert "--gpus KIND:COUNT" in out["strategy"]["skipped"]  # not this CPU's strategy
    assert main(["run", "--dry-run"]) == 0  # CPU: no GPU asked for
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (plan["device"], plan["trainer_gpus"], plan["generator_gpus"]) == ("cpu", 0.0, 0.0)


def test_a_cuda_run_without_a_gpu_is_refused_at_start(capsys, monkeypatch):
    from lockstep.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["run", "--dry-run", "model.device='cuda'"]) == 2
    assert "model.device = 'cuda' but no GPU is visible here" in capsys.readouterr().err
    spec = load(None, ["model.device='cuda'", "runtime.gpus=1", "rollout.replicas='auto'"])
    assert make_plan(spec).max_generator_replicas == make_plan(spec).generator_replicas  # GPU shares are fixed


def test_a_cuda_run_without_triton_is_refused_at_start(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ConfigError, match=r"Triton is not installed: pip install 'lockstep\[gpu\]'"):
        make_plan(load(None, ["model.device='cuda'", "runtime.gpus=1"]))


def test_the_engine_refuses_cuda_without_a_gpu_and_bf16_on_cpu(builtin_dir):
    import torch

    from lockstep.engine.device import Compute
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import EngineError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(EngineError, match="device='cuda' but torch sees no GPU"):
        Trainer.from_pretrained(builtin_dir, compute=Compute("cuda", "bfloat16"))
    with pytest.raises(EngineError, match="dtype='bfloat16' needs device='cuda'"):
        Compute("cpu", "bfloat16")


def test_consistency_check_on_cuda_without_a_gpu_says_so(capsys):
    import torch

    from lockstep.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["check", "consistency", "--device", "cuda", "--dtype", "bfloat16"]) == 2
    assert "torch sees no GPU" in capsys.readouterr().err


def test_the_service_refuses_cuda_without_a_gpu(tmp_path):
    import torch

    from lockstep.engine.types import EngineError
    from lockstep.runtime.plan import require_gpus
    from lockstep.service.host import EngineHost

    with pytest.raises(ConfigError, match="--device = 'cuda' but no GPU is visible here.*--device cpu"):
        require_gpus(0, "--device", "start the worker with --device cpu")  # the worker, before Ray starts
    if not torch.cuda.is_available():  # the engine host itself, should a worker get that far
        with pytest.raises(EngineError, match="torch sees no GPU"):
            EngineHost(str(tmp_path / "storage"), str(tmp_path / "cache"), 1, device="cuda", dtype="bfloat16")


def test_jobs_ask_for_gpus_within_the_operators_cap():
    from lockstep.service.policy import Limits, check_spec
    from lockstep.service.types import ServiceError

    cuda = {"model": {"device": "cuda", "dtype": "bfloat16"}}
    with pytest.raises(ServiceError, match=r"this server runs jobs on CPU only \(max_job_gpus = 0\)"):
        check_spec(cuda, Limits())
    with pytest.raises(ServiceError, match="runtime.gpus = 4 is over this server's cap max_job_gpus = 2"):
        check_spec({**cuda, "runtime": {"gpus": 4}}, Limits(max_job_gpus=2))
    assert check_spec({**cuda, "runtime": {"gpus": 1}}, Limits(max_job_gpus=2)).runtime.gpus == 1
    assert check_spec({}, Limits()).model.device == "cpu"


def test_a_gpu_host_copies_a_sessions_weights_onto_the_device_once():
    """Pinned sampler weights stay in host memory; a skeleton on another device (here torch's
    "meta" device stands in for a GPU) gets a copy, and not again while it holds that session's."""
    import types

    import torch

    from lockstep.service.host import _hold

    class Counted(dict):
        reads = 0

        def __getitem__(self, key):
            self.reads += 1
            return super().__getitem__(key)

    skeleton = types.SimpleNamespace(params={"w": torch.nn.Parameter(torch.zeros(3, device="meta"))})
    a, b = Counted(w=torch.ones(3)), Counted(w=torch.full((3,), 2.0))
    _hold(skeleton, "a", a)
    assert skeleton.params["w"].device.type == "meta" and skeleton.held_session == "a" and a.reads == 1
    _hold(skeleton, "a", a)
    assert a.reads == 1  # still holding session a: no second copy
    _hold(skeleton, "b", b)
    assert skeleton.held_session == "b" and b.reads == 1
    cpu = types.SimpleNamespace(params={"w": torch.nn.Parameter(torch.zeros(3))})
    _hold(cpu, "a", a)
    assert cpu.params["w"].data_ptr() == a["w"].data_ptr()  # on the CPU: the pinned tensor itself
