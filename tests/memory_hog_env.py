"""A user env (a module an operator allowlists) that allocates `env.size` MiB while its suite is
built, then refuses to run: what a dataset that decodes to gigabytes does to a job's process. The
memory tests run jobs on it (tests/test_service_jobs.py, tests/test_service_job_memory.py)."""

from lockstep.envs.types import EnvError

CHUNK_MIB = 64


def make_suite(spec, tokenizer, seed):
    held = []
    for _ in range(spec.size // CHUNK_MIB):
        held.append(b"\x01" * (CHUNK_MIB << 20))  # written, so resident: not a lazy mapping
        print(f"memory hog: holding {len(held) * CHUNK_MIB} MiB", flush=True)
    raise EnvError(f"memory hog: allocated all {len(held) * CHUNK_MIB} MiB")
