// Where lanes' results become protobuf: the output sinks that let a lane write O, the LSE and
// the gradients straight into a response's bytes, and the rest of the response (dtype, shape,
// path, engine, timing, batch) from the lane's ExecutionReport. The service's door; nothing
// behind it sees a wire type.
#pragma once

#include "attnserve/v1/attention.pb.h"
#include "server/work.h"

namespace attnserve {

// Points the work's O and LSE sinks at the response (O at its shared-memory range when the
// request gave one).
void BindOutputs(ForwardWork* work, v1::AttendResponse* response);
void BindOutputs(BackwardWork* work, v1::AttendBackwardResponse* response);
void BindOutputs(SessionStepWork* work, v1::AttendResponse* response);

// The response around the bytes the lane wrote.
void FillResponse(const ForwardWork& work, v1::AttendResponse* response);
void FillResponse(const BackwardWork& work, v1::AttendBackwardResponse* response);
void FillResponse(const SessionStepWork& work, v1::AttendResponse* response);

v1::Path PathOf(attn::EngineKind kind);

}  // namespace attnserve
