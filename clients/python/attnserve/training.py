"""Training jobs (attnserve.v1.TrainingService): submit one, watch it, cancel it, collect its
weights.

    with attnserve.Client("127.0.0.1:50051") as c:
        job = c.train(task="associative_recall", steps=300)    # a TrainingJob handle
        for status in job.watch():                             # until the job ends
            print(status.step, status.loss, status.tokens_per_second)
        result = job.result()                                  # waits for the end
        result.weights["w_q"]        # numpy float32 [model_dim, num_heads * head_dim]
        result.loss                                            # the loss curve, one value per step

The layer (training.proto has the formulas): q = x w_q, k = x w_k, v = x w_v, attention, y = a w_o,
then optionally out = x + y and LayerNorm. Weights are row-major and multiply from the right
(PyTorch's nn.Linear stores the transpose). Data is either a synthetic task ("associative_recall",
"copy") the server generates from a seed, or arrays the client uploads (inputs and targets of
shape [num_sequences, seqlen, model_dim]; the loss is then their mean squared error), sent in
chunks when large. A job belongs to the token that submitted it.
"""
from dataclasses import dataclass
from typing import Dict, Optional

import grpc
import numpy as np
from google.protobuf import descriptor_pb2

from attnserve import arrays
from attnserve._proto import enum_names, pb
from attnserve.errors import AttnServeError, invalid

try:
    from attnserve.v1 import training_pb2 as tpb
except ImportError as e:  # the same cause and cure as attention_pb2's (see _proto.py)
    if not (e.name or "").startswith("attnserve.v1"):
        raise
    raise ImportError("attnserve: attnserve.v1.training_pb2 is missing; reinstall the package "
                      "(pip install ./clients/python) so that it is generated") from e

SERVICE = tpb.DESCRIPTOR.services_by_name["TrainingService"]
STATES = {v.number: v.name.removeprefix("TRAINING_JOB_").lower()
          for v in tpb.TrainingJobState.DESCRIPTOR.values}  # "queued", "running", ...
FINISHED = ("succeeded", "failed", "cancelled")
TASKS = {"associative_recall": tpb.SYNTHETIC_TASK_ASSOCIATIVE_RECALL,
         "recall": tpb.SYNTHETIC_TASK_ASSOCIATIVE_RECALL, "copy": tpb.SYNTHETIC_TASK_COPY}
OPTIMIZERS = {"adamw": tpb.OPTIMIZER_ADAMW, "sgd": tpb.OPTIMIZER_SGD}
SCHEDULES = {"constant": tpb.LR_SCHEDULE_CONSTANT, "cosine": tpb.LR_SCHEDULE_COSINE,
             "linear": tpb.LR_SCHEDULE_LINEAR}
PATHS = enum_names(pb.Path.DESCRIPTOR)
CHUNK_BYTES = 4 << 20


class Stub:
    """TrainingService's methods on a grpc.Channel or grpc.aio.Channel, built from its
    descriptor as _proto.Stub builds AttentionService's."""

    def __init__(self, channel):
        factories = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                     (True, False): channel.stream_unary, (True, True): channel.stream_stream}
        for method in SERVICE.methods:
            shape = descriptor_pb2.MethodDescriptorProto()
            method.CopyToProto(shape)
            request = getattr(tpb, method.input_type.name)
            response = getattr(tpb, method.output_type.name)
            factory = factories[(shape.client_streaming, shape.server_streaming)]
            setattr(self, method.name,
                    factory(f"/{SERVICE.full_name}/{method.name}",
                            request_serializer=request.SerializeToString,
                            response_deserializer=response.FromString))


@dataclass(frozen=True)
class JobStatus:
    """A job as the server reports it (GetTrainingJob, each WatchTrainingJob event)."""

    job_id: str
    name: str
    state: str  # "queued", "running", "succeeded", "failed", "cancelled"
    step: int
    total_steps: int
    loss: float
    eval_metric: float
    eval_metric_name: str  # "accuracy" (synthetic tasks) or "rmse" (uploaded data)
    tokens_per_second: float
    eta_seconds: float
    learning_rate: float
    error: str  # why it failed
    resumed_from_step: int  # > 0: it resumed from a checkpoint after a restart
    checkpoint_step: int
    forward_engine: str
    backward_engine: str
    deterministic: bool  # the run's backward passes: the spec asked, or the server forces it

    @property
    def finished(self):
        return self.state in FINISHED

    @classmethod
    def of(cls, job):
        p = job.progress
        return cls(job_id=job.job_id, name=job.display_name, state=STATES.get(job.state, "?"),
                   step=p.step, total_steps=p.total_steps, loss=p.loss,
                   eval_metric=p.eval_metric, eval_metric_name=p.eval_metric_name,
                   tokens_per_second=p.tokens_per_second, eta_seconds=p.eta_seconds,
                   learning_rate=p.learning_rate, error=job.error,
                   resumed_from_step=job.resumed_from_step, checkpoint_step=job.checkpoint_step,
                   forward_engine=job.forward_engine, backward_engine=job.backward_engine,
                   deterministic=job.deterministic)


@dataclass(frozen=True)
class TrainingResult:
    """An ended job's weights (numpy float32 arrays by name: w_q, w_k, w_v, w_o, and ln_gain,
    ln_bias with layer_norm) and its curves (steps[i] is the step of loss[i] and metric[i])."""

    job_id: str
    state: str
    weights: Dict[str, np.ndarray]
    steps: np.ndarray
    loss: np.ndarray
    metric: np.ndarray
    status: Optional[JobStatus] = None

    @classmethod
    def of(cls, result, status=None):
        weights = {}
        for named in result.weights:
            values, form = arrays.from_tensor(named.tensor)
            weights[named.name] = np.array(arrays.convert(values, form, "float32"))
        return cls(job_id=result.job_id, state=STATES.get(result.state, "?"), weights=weights,
                   steps=np.array(result.loss_curve_steps, dtype=np.int64),
                   loss=np.array(result.loss_curve, dtype=np.float32),
                   metric=np.array(result.eval_curve, dtype=np.float32), status=status)


def _tensor(x, name, wire=None):
    """A float Tensor message of an array (numpy, ml_dtypes.bfloat16 or torch)."""
    values, form, _ = arrays.values_of(x, name, wire)
    to = wire or form
    return arrays.to_tensor(arrays.convert(values, form, to), to)


def _choice(value, table, name):
    if value not in table:
        raise invalid(f"{name}: {value!r} is not one of {', '.join(table)}")
    return table[value]


def spec(*, task=None, inputs=None, targets=None, model_dim=None, num_heads=4, num_kv_heads=None,
         head_dim=16, causal=True, window_size=(-1, -1), residual=True, layer_norm=True,
         vocab_size=16, task_seed=0, batch_size=16, seqlen=None, steps=300, dtype="float32",
         seed=0, path="auto", optimizer="adamw", learning_rate=1e-2, schedule="constant",
         warmup_steps=0, min_learning_rate=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
         max_grad_norm=0.0, initial_weights=None, checkpoint_every=0, deterministic=False,
         name="", chunk_bytes=CHUNK_BYTES):
    """(the SubmitTrainingJob messages, in order) for Client.train's arguments."""
    if (inputs is None) != (targets is None):
        raise invalid("inputs, targets: pass both (uploaded data) or neither (a synthetic task)")
    s = tpb.TrainingJobSpec(display_name=name, steps=int(steps), batch_size=int(batch_size),
                            seed=int(seed), checkpoint_every=int(checkpoint_every),
                            path=_choice(path, PATHS, "path"), deterministic=bool(deterministic))
    s.dtype = arrays.WIRE_DTYPES[arrays.dtype_name(dtype)]
    chunks = []
    if inputs is None:
        s.data.synthetic.kind = _choice(task or "associative_recall", TASKS, "task")
        s.data.synthetic.vocab_size = int(vocab_size)
        s.data.synthetic.seed = int(task_seed)
        s.seqlen = int(seqlen if seqlen is not None else 32)
        s.model.model_dim = int(model_dim if model_dim is not None else 64)
    else:
        if task is not None:
            raise invalid("task: a synthetic task or uploaded inputs, not both")
        uploaded = s.data.uploaded
        for field, x, key in (("inputs", inputs, tpb.DataChunk.FIELD_INPUTS),
                              ("targets", targets, tpb.DataChunk.FIELD_TARGETS)):
            t = _tensor(x, field)
            if len(t.shape) != 3:
                raise invalid(f"{field}.shape: {list(t.shape)}; expected [num_sequences, "
                              "seqlen, model_dim]")
            if len(t.data) > chunk_bytes:
                data = t.data
                t.data = b""
                chunks += [tpb.SubmitTrainingJobRequest(chunk=tpb.DataChunk(
                    field=key, offset=at, data=data[at:at + chunk_bytes]))
                    for at in range(0, len(data), chunk_bytes)]
            getattr(uploaded, field).CopyFrom(t)
        s.seqlen = int(seqlen if seqlen is not None else uploaded.inputs.shape[1])
        s.model.model_dim = int(model_dim if model_dim is not None else uploaded.inputs.shape[2])
    m = s.model
    m.num_heads = int(num_heads)
    m.num_kv_heads = int(num_kv_heads if num_kv_heads is not None else num_heads)
    m.head_dim = int(head_dim)
    m.causal = bool(causal)
    left, right = (int(w) for w in window_size)
    if left >= 0:
        m.window_left = left
    if right >= 0:
        m.window_right = right
    m.residual = bool(residual)
    m.layer_norm = bool(layer_norm)
    o = s.optimizer
    o.kind = _choice(optimizer, OPTIMIZERS, "optimizer")
    o.learning_rate = float(learning_rate)
    o.schedule = _choice(schedule, SCHEDULES, "schedule")
    o.warmup_steps = int(warmup_steps)
    o.min_learning_rate = float(min_learning_rate)
    o.beta1, o.beta2 = (float(b) for b in betas)
    o.epsilon = float(eps)
    o.weight_decay = float(weight_decay)
    o.max_grad_norm = float(max_grad_norm)
    for weight_name, value in (initial_weights or {}).items():
        s.initial_weights.add(name=weight_name,
                              tensor=_tensor(value, f"initial_weights[{weight_name}]", "float32"))
    return [tpb.SubmitTrainingJobRequest(spec=s)] + chunks


def _failed(status):
    return AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"training job {status.job_id} failed: {status.error}")


class TrainingJob:
    """A submitted job: status(), watch(), wait(), cancel(), result(). Obtained from
    Client.train (or Client.training_job for an id); methods raise AttnServeError."""

    def __init__(self, client, job_id, status=None):
        self._client = client
        self.job_id = job_id
        self.submitted = status  # the JobStatus SubmitTrainingJob returned

    def __repr__(self):
        return f"TrainingJob({self.job_id!r})"

    def _call(self, method, request, timeout=None):
        return self._client._training_unary(method, request, timeout)

    def status(self, *, timeout=None):
        return JobStatus.of(self._call("GetTrainingJob",
                                       tpb.GetTrainingJobRequest(job_id=self.job_id), timeout))

    def watch(self, *, timeout=None):
        """Yields a JobStatus now and as the job progresses (at most ~10 per second), the last
        one when it ends. timeout: for the whole watch (default none: as long as it takes)."""
        call = self._client._training_stub.WatchTrainingJob(
            tpb.WatchTrainingJobRequest(job_id=self.job_id), timeout=timeout,
            metadata=self._client._metadata)
        try:
            for event in call:
                yield JobStatus.of(event.job)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None
        finally:
            call.cancel()

    def wait(self, *, timeout=None):
        """Blocks until the job ends; its final JobStatus."""
        last = self.submitted
        for last in self.watch(timeout=timeout):
            pass
        if last is None or not last.finished:
            last = self.status()
        return last

    def cancel(self, *, timeout=None):
        """Ends a queued job now, a running one after its current step; its JobStatus."""
        return JobStatus.of(self._call("CancelTrainingJob",
                                       tpb.CancelTrainingJobRequest(job_id=self.job_id), timeout))

    def result(self, *, wait=True, timeout=None):
        """The TrainingResult of the ended job (waiting for the end unless wait=False). A job
        that FAILED raises AttnServeError with its error; a CANCELLED one returns the weights
        of its last step."""
        status = self.wait(timeout=timeout) if wait else self.status()
        if status.state == "failed":
            raise _failed(status)
        return TrainingResult.of(self._call(
            "GetTrainingResult", tpb.GetTrainingResultRequest(job_id=self.job_id), None), status)


class AsyncTrainingJob:
    """TrainingJob for AsyncClient: the same methods, as coroutines (watch an async
    generator)."""

    def __init__(self, client, job_id, status=None):
        self._client = client
        self.job_id = job_id
        self.submitted = status

    def __repr__(self):
        return f"AsyncTrainingJob({self.job_id!r})"

    async def _call(self, method, request, timeout=None):
        return await self._client._training_unary(method, request, timeout)

    async def status(self, *, timeout=None):
        return JobStatus.of(await self._call(
            "GetTrainingJob", tpb.GetTrainingJobRequest(job_id=self.job_id), timeout))

    async def watch(self, *, timeout=None):
        call = self._client._training_stub.WatchTrainingJob(
            tpb.WatchTrainingJobRequest(job_id=self.job_id), timeout=timeout,
            metadata=self._client._metadata)
        try:
            async for event in call:
                yield JobStatus.of(event.job)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None
        finally:
            call.cancel()

    async def wait(self, *, timeout=None):
        last = self.submitted
        async for last in self.watch(timeout=timeout):
            pass
        if last is None or not last.finished:
            last = await self.status()
        return last

    async def cancel(self, *, timeout=None):
        return JobStatus.of(await self._call(
            "CancelTrainingJob", tpb.CancelTrainingJobRequest(job_id=self.job_id), timeout))

    async def result(self, *, wait=True, timeout=None):
        status = await (self.wait(timeout=timeout) if wait else self.status())
        if status.state == "failed":
            raise _failed(status)
        return TrainingResult.of(await self._call(
            "GetTrainingResult", tpb.GetTrainingResultRequest(job_id=self.job_id), None), status)


def submit(client, requests, timeout):
    """SubmitTrainingJob on a Client; the TrainingJob handle."""
    try:
        job = client._training_stub.SubmitTrainingJob(iter(requests),
                                                      timeout=client._deadline(timeout),
                                                      metadata=client._metadata)
    except grpc.RpcError as e:
        raise AttnServeError.from_rpc_error(e) from None
    return TrainingJob(client, job.job_id, JobStatus.of(job))


async def submit_async(client, requests, timeout):
    """SubmitTrainingJob on an AsyncClient; the AsyncTrainingJob handle."""
    async def stream():
        for r in requests:
            yield r
    try:
        job = await client._training_stub.SubmitTrainingJob(stream(),
                                                            timeout=client._deadline(timeout),
                                                            metadata=client._metadata)
    except grpc.RpcError as e:
        raise AttnServeError.from_rpc_error(e) from None
    return AsyncTrainingJob(client, job.job_id, JobStatus.of(job))


def statuses(response):
    return [JobStatus.of(job) for job in response.jobs]

