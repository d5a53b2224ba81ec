"""The Python training-job handle against the real server: a synthetic job learns and its
weights come back as numpy, watch() follows it to the end, cancel(), a job the server refuses
(result() raises its error), uploads in chunks, bfloat16 compute, asyncio, and jobs private to
their token."""
import asyncio

import grpc
import numpy as np
import pytest

from servers import Server

import attnserve


def test_recall_job_learns_and_returns_numpy_weights(client):
    job = client.train(task="associative_recall", steps=150, name="pytest recall")
    # A free worker may take the job before the answer to its submission is written.
    assert job.submitted.state in ("queued", "running"), job.submitted.error
    seen = list(job.watch())
    assert seen[-1].state == "succeeded"
    assert seen[-1].step == 150
    assert [s.step for s in seen] == sorted(s.step for s in seen)
    result = job.result()
    assert result.state == "succeeded"
    assert list(result.steps) == list(range(1, 151))
    assert result.loss[0] > 2.0  # chance: ln 16
    assert result.loss[-10:].mean() < 0.1
    assert result.metric[-1] > 0.95  # answer accuracy
    assert result.weights["w_q"].shape == (64, 64)  # [model_dim, num_heads * head_dim]
    assert result.weights["w_k"].shape == (64, 64)  # num_kv_heads defaults to num_heads
    assert result.weights["ln_gain"].shape == (64,)
    assert result.weights["w_o"].dtype == np.float32
    assert job.status().forward_engine == "cpu_tiled"


def test_cancel_ends_a_running_job(client):
    job = client.train(steps=10**7)
    for status in job.watch():
        if status.step >= 5:
            break
    cancelled = job.cancel()
    assert cancelled.state in ("running", "cancelled")
    final = job.wait(timeout=30)
    assert final.state == "cancelled"
    assert 5 <= final.step < 10**7
    result = job.result()
    assert result.state == "cancelled"
    assert len(result.steps) == final.step


def test_a_refused_job_is_failed_and_its_result_raises(client):
    job = client.train(steps=0)
    assert job.submitted.state == "failed"
    assert "steps: 0" in job.submitted.error
    with pytest.raises(attnserve.AttnServeError) as e:
        job.result()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "steps: 0" in e.value.message
    with pytest.raises(attnserve.AttnServeError) as e:
        client.train(task="induction")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_uploaded_data_in_chunks(client, rng):
    x = rng.standard_normal((6, 8, 16)).astype(np.float32)
    y = np.roll(x, 1, axis=1)  # the previous token: attention can learn to fetch it
    job = client.train(inputs=x, targets=y, num_heads=2, head_dim=8, batch_size=3, steps=40,
                       chunk_bytes=1000, learning_rate=3e-2)
    result = job.result(timeout=60)
    assert result.state == "succeeded"
    assert result.status.eval_metric_name == "rmse"
    assert result.loss[-5:].mean() < result.loss[:5].mean()
    assert result.weights["w_q"].shape == (16, 16)


def test_bfloat16_compute_with_float32_master_weights(client):
    result = client.train(steps=30, dtype="bfloat16").result(timeout=60)
    assert result.state == "succeeded"
    assert result.loss[-1] < result.loss[0]
    assert result.weights["w_v"].dtype == np.float32


def test_deterministic_jobs_say_so(client):
    asked = client.train(steps=5, deterministic=True)
    plain = client.train(steps=5)
    assert asked.wait(timeout=60).deterministic is True
    assert plain.wait(timeout=60).deterministic is False
    assert asked.status().deterministic is True


def test_async_client(server):
    async def run():
        async with attnserve.AsyncClient(server.target) as c:
            job = await c.train(steps=20)
            states = [s.state async for s in job.watch()]
            result = await job.result()
            listed = await c.training_jobs()
            return states, result, listed
    states, result, listed = asyncio.run(run())
    assert states[-1] == "succeeded"
    assert result.weights["w_o"].shape == (64, 64)
    assert result.job_id in [j.job_id for j in listed]


def test_jobs_are_private_to_their_token(binary, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice tok-alice-0001\nbob tok-bob-00001\n")
    s = Server(binary, f"--auth_token_file={tokens}")
    try:
        with attnserve.Client(s.target, token="tok-alice-0001") as alice, \
                attnserve.Client(s.target, token="tok-bob-00001") as bob:
            job = alice.train(steps=10)
            with pytest.raises(attnserve.AttnServeError) as e:
                bob.training_job(job.job_id)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            handle = attnserve.TrainingJob(bob, job.job_id)  # as if bob had learnt the id
            for call in (handle.status, handle.cancel, lambda: list(handle.watch()),
                         handle.result):
                with pytest.raises(attnserve.AttnServeError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.NOT_FOUND
            assert alice.training_job(job.job_id).submitted.job_id == job.job_id
            assert bob.training_jobs() == []
            assert job.result(timeout=60).state == "succeeded"
            assert [j.job_id for j in alice.training_jobs()] == [job.job_id]
    finally:
        assert s.stop() == 0
