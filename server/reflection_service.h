// Server reflection over grpc.reflection.v1 (proto/grpc/reflection/v1/reflection.proto),
// answered from a descriptor pool. gRPC 1.51's plugin serves only grpc.reflection.v1alpha, and
// current grpcurl and buf curl ask for v1 first; the server runs both side by side.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace attnserve {

// The answer to one reflection request. `services` is what list_services reports; files are
// looked up in `pool`, and each file sent brings the files it imports, directly or not.
grpc::reflection::v1::ServerReflectionResponse AnswerReflection(
    const google::protobuf::DescriptorPool& pool, const std::vector<std::string>& services,
    const grpc::reflection::v1::ServerReflectionRequest& request);

class ReflectionService final : public grpc::reflection::v1::ServerReflection::CallbackService {
 public:
  // Neither pointer is owned; both must outlive the service. `services` may still grow until the
  // server starts (gRPC adds its health service last).
  ReflectionService(const google::protobuf::DescriptorPool* pool,
                    const std::vector<std::string>* services)
      : pool_(pool), services_(services) {}

  grpc::ServerBidiReactor<grpc::reflection::v1::ServerReflectionRequest,
                          grpc::reflection::v1::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* context) override;

 private:
  const google::protobuf::DescriptorPool* pool_;
  const std::vector<std::string>* services_;
};

// Has the server that `builder` builds serve a ReflectionService over the generated pool, which
// lists that server's own services and is owned by it.
void AddReflectionService(grpc::ServerBuilder* builder);

}  // namespace attnserve
