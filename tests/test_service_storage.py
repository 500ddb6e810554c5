"""Storage you can trust: unique keys per save, a bounded fetch cache, the janitor (ttl_seconds,
abandoned sessions), and the engine host's bounded memory (an evicted model is rebuilt exactly)."""

import datetime as dt
import sqlite3
from contextlib import closing
from pathlib import Path

import httpx
import pytest
import tinker
from helpers import wait_until
from test_service_sdk import logprobs, make_server, reference_logprobs, sft_datum
from tinker import types

from lockstep.service.storage import FetchCache, Storage

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def committed_dir(root: Path, name: str, size: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "blob.bin").write_bytes(b"x" * size)
    (d / "MANIFEST.json").write_text("{}")
    return d


def test_fetch_cache_is_bounded_least_recently_used_first_and_never_evicts_what_is_in_use(tmp_path):
    storage = Storage(str(tmp_path / "storage"))
    for name in "abcd":
        storage.put_dir(committed_dir(tmp_path / "src", name, 1000), f"k/{name}")
    cache = FetchCache(storage, tmp_path / "cache", max_bytes=2500)  # room for two copies
    for name in "ab":
        with cache.fetch(f"k/{name}") as local:
            assert (local / "blob.bin").stat().st_size == 1000
    with cache.fetch("k/a"):  # a is now the most recently used
        pass
    with cache.fetch("k/c"):
        pass
    assert cache.keys() == ["k/a", "k/c"] and not (tmp_path / "cache" / "k" / "b").exists()
    assert cache.bytes <= 2500
    with cache.fetch("k/a") as held:  # in use: fetching two more must not remove it
        with cache.fetch("k/b"), cache.fetch("k/d"):
            assert (held / "blob.bin").read_bytes() == b"x" * 1000
        assert (held / "blob.bin").is_file()
    assert cache.bytes <= 2500 and len(cache.keys()) == 2
    # A new process finds what the last one left, within the bound, oldest first.
    again = FetchCache(storage, tmp_path / "cache", max_bytes=1500)
    with again.fetch("k/c"):
        pass
    assert again.keys() == ["k/c"]


def test_engine_host_holds_a_bounded_number_of_models_sessions_and_skeletons(tmp_path, builtin_dir):
    """Each tenant's model may have its own LoRA seed: LoRA sessions of any seed sample on the
    shared base (no skeleton), full fine-tunes' sessions share one skeleton per base model (one per
    model grew memory with every model), and every table is an LRU."""
    from lockstep.service.host import EngineHost

    host = EngineHost(str(tmp_path / "storage"), str(tmp_path / "cache"), 1, max_models=2, max_sessions=2,
                      max_skeletons=2)  # room for two: one per model would show
    for seed in range(3):
        host.create_model(f"m{seed}", builtin_dir, {"rank": 4, "seed": seed})
        host.snapshot_session(f"m{seed}", f"s{seed}", f"snap/{seed}", builtin_dir, {"rank": 4, "seed": seed})
    assert list(host.trainers) == ["m1", "m2"] and list(host.sessions) == ["s1", "s2"]
    prompt = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}, "num_samples": 1,
              "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
    host.sample("s2", prompt)
    host.sample("s1", prompt)
    assert list(host.sessions) == ["s2", "s1"]  # used: now the newest
    assert host.skeletons == {}  # LoRA snapshots are adapters on the shared base
    for i in range(2):  # full fine-tunes have weights of their own, pinned over one skeleton
        host.create_model(f"f{i}", builtin_dir, None)
        host.snapshot_session(f"f{i}", f"t{i}", f"snap/f{i}", builtin_dir, None)
        host.sample(f"t{i}", prompt)
    assert list(host.sessions) == ["t0", "t1"] and len(host.skeletons) == 1  # two models, one skeleton


def store(srv):
    return closing(sqlite3.connect(srv.db.removeprefix("sqlite:///"), timeout=30))


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """A server whose host holds one trainer and one sampler, whose fetch cache holds 1 MiB, and
    whose janitor runs every second."""
    srv = make_server(tmp_path_factory.mktemp("tight"))
    srv.keys = {"dana": srv.key("dana")}
    srv.start("--max-models", "1", "--max-samplers", "1", "--janitor-every", "1", "--fetch-cache-mb", "1")
    yield srv
    srv.stop()


@pytest.mark.parametrize("lora", [pytest.param({}, marks=pytest.mark.slow), {"train_unembed": False}],
                         ids=["sdk-default-lm_head", "no-lm_head"])  # slow: time
def test_models_evicted_from_memory_continue_bit_for_bit(tight, builtin_dir, lora):
    """Two models trained in turn on a host that holds one: each is spilled and rebuilt at every
    switch, and ends exactly where an uninterrupted run on a peft Trainer does. Both specs (the
    SDK's default with lm_head, and one without) run on the worker's shared base as AdapterTrainers:
    the same bits end to end as the private peft reference."""
    sc = tinker.ServiceClient(base_url=tight.url, api_key=tight.keys["dana"])
    a = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=5, **lora).result()
    b = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=6, **lora).result()
    tok = a.get_tokenizer()
    data = [sft_datum(tok, f"{x}+{y}=", f"{x + y:02d}") for x in range(4) for y in range(4)]
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(3):
        for tc in (a, b):  # a forward_backward waits in memory for its optim_step across a switch
            tc.forward_backward(data, "cross_entropy").result()
        for tc in (a, b):
            tc.optim_step(adam).result()
    got = {seed: logprobs(tc.forward(data, "cross_entropy").result()) for seed, tc in ((5, a), (6, b))}
    for seed in (5, 6):
        want = reference_logprobs(builtin_dir, data, steps=3, lr=1e-2, seed=seed, **lora)
        assert all((x == y).all() for x, y in zip(got[seed], want))
    # Samplers too: two snapshots alternately, each reopened from storage after an eviction.
    s1, s2 = a.save_weights_and_get_sampling_client(), b.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tok.encode("1+2=03"))
    first = [s.compute_logprobs(prompt).result() for s in (s1, s2)]
    again = [s.compute_logprobs(prompt).result() for s in (s1, s2)]
    assert first == again and first[0] != first[1]


def test_overwrite_then_load_gives_the_new_weights(tight):
    """A name saved, loaded (so a copy sits in the worker's fetch cache), trained on and saved
    again with overwrite=True: loading it gives the new weights, not the cached old ones."""
    sc = tinker.ServiceClient(base_url=tight.url, api_key=tight.keys["dana"])
    tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=3).result()
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, f"{x}+{x}=", f"{2 * x:02d}") for x in range(8)]
    path = tc.save_state("same").result().path
    old = logprobs(sc.create_training_client_from_state(path).result().forward(data, "cross_entropy").result())
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.save_state("same", overwrite=True).result().path == path
    new = logprobs(tc.forward(data, "cross_entropy").result())
    loaded = logprobs(sc.create_training_client_from_state(path).result().forward(data, "cross_entropy").result())
    assert all((a == b).all() for a, b in zip(loaded, new))
    assert not all((a == b).all() for a, b in zip(loaded, old))
    with store(tight) as con:
        keys = [k for (k,) in con.execute("select storage_path from checkpoints where name = 'same'")]
    saves = list((Path(tight.storage) / keys[0]).parents[2].iterdir())  # checkpoints/<tenant>/<model>/<save id>/...
    assert len(keys) == 1 and len(saves) == 1  # the old copy is gone


def test_an_expired_checkpoint_is_deleted_and_its_path_is_a_404(tight):
    sc = tinker.ServiceClient(base_url=tight.url, api_key=tight.keys["dana"])
    tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=1).result()
    kept = tc.save_state("kept").result().path
    brief = tc.save_state("brief", ttl_seconds=3600).result().path
    with store(tight) as con:
        key, expires = con.execute("select storage_path, expires_at from checkpoints where name = 'brief'").fetchone()
        left = dt.datetime.fromisoformat(expires) - dt.datetime.utcnow()
        assert dt.timedelta(minutes=59) < left <= dt.timedelta(hours=1)
        assert (Path(tight.storage) / key / "MANIFEST.json").is_file()
        with con:  # an hour later
            con.execute("update checkpoints set expires_at = ? where name = 'brief'",
                        ((dt.datetime.utcnow() - dt.timedelta(seconds=1)).isoformat(sep=" "),))
    rest = sc.create_rest_client()
    wait_until(lambda: [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
               == ["weights/kept"], timeout=30, what="the janitor")
    wait_until(lambda: not (Path(tight.storage) / key).exists(), timeout=10, what="its storage (after the row)")
    r = httpx.post(f"{tight.url}/api/v1/weights_info", headers={"X-API-Key": tight.keys["dana"]},
                   json={"tinker_path": brief})
    assert r.status_code == 404
    with pytest.raises(Exception, match="404|no checkpoint"):
        sc.create_training_client_from_state(brief).result()
    assert sc.create_training_client_from_state(kept).result().model_id  # the other one is untouched


def test_sampling_sessions_of_ended_sessions_are_deleted(tight):
    """A finished session's sampler snapshots go (rows, then storage); so do the samplers of a
    session whose heartbeats stopped longer than the TTL ago."""
    headers = {"X-API-Key": tight.keys["dana"]}
    sc = tinker.ServiceClient(base_url=tight.url, api_key=tight.keys["dana"])
    tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=2).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    sampler.compute_logprobs(prompt).result()  # it exists and samples
    with store(tight) as con:
        sid, key = con.execute("select session_id, weights_path from sampling_sessions where id like ?",
                               (tc.model_id + ":%",)).fetchone()
    assert key.startswith("ephemeral/") and (Path(tight.storage) / key / "MANIFEST.json").is_file()
    quiet = httpx.post(f"{tight.url}/api/v1/create_session", headers=headers, json={"tags": [], "sdk_version": "x"}).json()
    r = httpx.post(f"{tight.url}/api/v1/create_sampling_session", headers=headers,
                   json={"session_id": quiet["session_id"], "sampling_session_seq_id": 0, "base_model": "lockstep/tiny"})
    quiet_sampler = r.json()["sampling_session_id"]
    with store(tight) as con, con:  # its last heartbeat was two days ago
        con.execute("update sessions set last_heartbeat = ? where id = ?",
                    ((dt.datetime.utcnow() - dt.timedelta(days=2)).isoformat(sep=" "), quiet["session_id"]))
    assert httpx.post(f"{tight.url}/api/v1/sessions/{sid}/finish", headers=headers, json={}).status_code == 200
    wait_until(lambda: not (Path(tight.storage) / key).exists(), timeout=30, what="the snapshot's deletion")
    with store(tight) as con:
        left = {row[0] for row in con.execute("select id from sampling_sessions where session_id in (?, ?)",
                                              (sid, quiet["session_id"]))}
    assert left == set(), left
    assert httpx.get(f"{tight.url}/api/v1/samplers/{quiet_sampler}", headers=headers).status_code == 404
    with pytest.raises(Exception, match="404|unknown sampling"):
        sampler.compute_logprobs(prompt).result()


def test_a_store_made_by_an_older_version_gets_the_new_columns_and_keeps_its_rows(tmp_path):
    """`requests.attempts` and `jobs.run_seconds` came after the first release: opening an older
    service.db adds them (with their defaults) instead of failing every claim or every job insert."""
    from lockstep.service import db

    url = f"sqlite:///{tmp_path}/service.db"
    engine, _ = db.connect(url)
    engine.dispose()
    with closing(sqlite3.connect(tmp_path / "service.db")) as con, con:
        for table, name in (("requests", "attempts"), ("jobs", "run_seconds")):
            con.execute(f"alter table {table} drop column {name}")
        con.execute("insert into tenants (id, name, key_hash, max_concurrent_jobs, max_models, created_at) "
                    "values ('t', 't', 'h', 2, 16, '2026-01-01')")
        con.execute("insert into jobs (id, tenant_id, name, spec, priority, state, attempts, max_attempts, preemptions, "
                    "next_attempt_at, created_at) values ('old-job', 't', 'kept', '{}', 'reserved', 'succeeded', 1, 3, "
                    "0, '2026-01-01', '2026-01-01')")
    engine, sessions = db.connect(url)
    with sessions() as s:
        job = s.get(db.Job, "old-job")
        assert (job.name, job.state, job.run_seconds) == ("kept", "succeeded", 0.0)
    with closing(sqlite3.connect(tmp_path / "service.db")) as con:  # a raw insert (an older worker) still works
        con.execute("insert into jobs (id, tenant_id, name, spec, priority, state, attempts, max_attempts, preemptions, "
                    "next_attempt_at, created_at) values ('new-job', 't', '', '{}', 'reserved', 'queued', 0, 3, "
                    "0, '2026-01-01', '2026-01-01')")
        assert con.execute("select run_seconds from jobs where id = 'new-job'").fetchone() == (0.0,)
    db.connect(url)[0].dispose()  # a second open (another process starting) changes nothing
    engine.dispose()


def test_save_state_then_load_through_the_engine_host_is_exact_fifty_times(tmp_path, builtin_dir):
    """Train a step, save, rebuild a fresh model from the save, 50 times: every rebuild holds the
    same weights and Adam moments, bit for bit, and continues exactly as the original does."""
    import numpy as np
    import torch
    from test_service_api import fwdbwd

    from lockstep.service.host import EngineHost

    host = EngineHost(str(tmp_path / "storage"), str(tmp_path / "cache"), 2, max_models=4)
    lora = {"rank": 4, "seed": 3}
    host.create_model("m", builtin_dir, lora)
    adam = {"learning_rate": 1e-2}

    def step(model_id, i):
        tokens = tuple(int(t) for t in np.random.default_rng(i).integers(4, 200, 24))
        host.forward_backward(model_id, fwdbwd(model_id, 1, tokens=tokens), forward_only=False)
        return host.optim_step(model_id, adam)

    def state(model_id):
        t = host.trainers[model_id]
        per_param = [t.optimizer.state[p] for p in t.params.values()]
        moments = [s[k] for s in per_param for k in sorted(s) if torch.is_tensor(s[k])]
        return t.weights_numpy(), moments

    for i in range(50):
        step("m", i)
        host.save_state("m", f"states/{i}")
        host.drop_model("copy")
        host.restore_state("copy", builtin_dir, lora, f"states/{i}")
        (w, m), (cw, cm) = state("m"), state("copy")
        assert all(np.array_equal(w[k], cw[k]) for k in w) and w.keys() == cw.keys(), i
        assert len(m) == len(cm) and all(torch.equal(a, b) for a, b in zip(m, cm)), i
        if i % 10 == 9:  # and the copy trains on exactly as the original
            step("m", 1000 + i), step("copy", 1000 + i)
            w, cw = state("m")[0], state("copy")[0]
            assert all(np.array_equal(w[k], cw[k]) for k in w), i


@pytest.mark.parametrize("drafter", ["suffix", "model"])
def test_speculative_sampling_sessions_answer_exactly_as_plain_ones(tmp_path, builtin_dir, drafter):
    """`lockstep serve --speculative suffix|model`: every sampling session drafts from its own
    history only (never another session's, which may be another tenant's: each has its own drafter,
    a model drafter its own draft learning from that session's samples), and its responses are
    byte for byte those of a worker without speculation (same weights, seeds and requests)."""
    from lockstep.service.host import EngineHost, HostError

    hosts = {mode: EngineHost(str(tmp_path / mode / "storage"), str(tmp_path / mode / "cache"), 1, speculative=mode,
                              draft_tokens=4) for mode in ("off", drafter)}
    for host in hosts.values():
        host.create_model("m", builtin_dir, {"rank": 4, "seed": 1})
        for s in ("s1", "s2"):
            host.snapshot_session("m", s, f"snap/{s}", builtin_dir, {"rank": 4, "seed": 1})
    replies = {}
    for mode, host in hosts.items():
        replies[mode] = [host.sample(s, {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, i]}]},
                                         "num_samples": 4, "sampling_params": {"max_tokens": 24, "seed": i,
                                                                               "temperature": 0.0 if i % 2 else 1.0}})
                         for i in range(4) for s in ("s1", "s2")]
    assert replies[drafter] == replies["off"]
    spec = hosts[drafter]
    s1, s2 = spec.sessions["s1"].speculation, spec.sessions["s2"].speculation
    assert s1["drafter"] is not s2["drafter"] and s1["auto"] is not s2["auto"] and s1["auto"].observed > 0
    assert hosts["off"].sessions["s1"].speculation is None
    with pytest.raises(HostError, match="unknown drafter"):
        EngineHost(str(tmp_path / "x"), str(tmp_path / "y"), 1, speculative="tree")
