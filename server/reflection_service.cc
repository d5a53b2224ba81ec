#include "server/reflection_service.h"

#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <grpcpp/impl/server_initializer.h>

#include <algorithm>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.pb.h"
#include "server/grpc_status.h"
#include "server/logging.h"

namespace attnserve {
namespace {

namespace pb = google::protobuf;
using grpc::reflection::v1::ServerReflectionRequest;
using grpc::reflection::v1::ServerReflectionResponse;

// Appends `file` and, after it, every file it imports that is not in the response yet.
void AddFileAndImports(const pb::FileDescriptor* file, absl::flat_hash_set<std::string>* sent,
                       grpc::reflection::v1::FileDescriptorResponse* out) {
  if (!sent->insert(file->name()).second) return;
  pb::FileDescriptorProto proto;
  file->CopyTo(&proto);
  proto.SerializeToString(out->add_file_descriptor_proto());
  for (int i = 0; i < file->dependency_count(); ++i) {
    AddFileAndImports(file->dependency(i), sent, out);
  }
}

// The file a file-valued request names.
absl::StatusOr<const pb::FileDescriptor*> FindFile(const pb::DescriptorPool& pool,
                                                   const ServerReflectionRequest& request) {
  switch (request.message_request_case()) {
    case ServerReflectionRequest::kFileByFilename:
      if (const pb::FileDescriptor* file = pool.FindFileByName(request.file_by_filename())) {
        return file;
      }
      return absl::NotFoundError(absl::StrCat("no file named '", request.file_by_filename(), "'"));
    case ServerReflectionRequest::kFileContainingSymbol:
      if (const pb::FileDescriptor* file =
              pool.FindFileContainingSymbol(request.file_containing_symbol())) {
        return file;
      }
      return absl::NotFoundError(
          absl::StrCat("no symbol named '", request.file_containing_symbol(), "'"));
    case ServerReflectionRequest::kFileContainingExtension: {
      const auto& wanted = request.file_containing_extension();
      const pb::Descriptor* type = pool.FindMessageTypeByName(wanted.containing_type());
      if (type == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("no message type named '", wanted.containing_type(), "'"));
      }
      const pb::FieldDescriptor* extension =
          pool.FindExtensionByNumber(type, wanted.extension_number());
      if (extension == nullptr) {
        return absl::NotFoundError(absl::StrCat(wanted.containing_type(), " has no extension ",
                                                wanted.extension_number()));
      }
      return extension->file();
    }
    default:
      return absl::InternalError("not a file request");
  }
}

void SetError(const absl::Status& status, ServerReflectionResponse* response) {
  const grpc::Status wire = ToGrpcStatus(status);
  response->mutable_error_response()->set_error_code(wire.error_code());
  response->mutable_error_response()->set_error_message(wire.error_message());
}

// One reflection stream: each request read is answered before the next is read.
class ReflectionReactor final
    : public grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse> {
 public:
  ReflectionReactor(const pb::DescriptorPool* pool, const std::vector<std::string>* services)
      : pool_(pool), services_(services) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed, or the call is over
      Finish(grpc::Status::OK);
      return;
    }
    response_ = AnswerReflection(*pool_, *services_, request_);
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "reflection: the response was not sent"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  const pb::DescriptorPool* pool_;
  const std::vector<std::string>* services_;
  ServerReflectionRequest request_;
  ServerReflectionResponse response_;
};

// A ServerBuilder plugin is the one place where gRPC hands out the server's list of service
// names, and lets the server own a service it registers.
class ReflectionPlugin final : public grpc::ServerBuilderPlugin {
 public:
  std::string name() override { return "attnserve_reflection_v1"; }
  void InitServer(grpc::ServerInitializer* si) override {
    if (!si->RegisterService(std::make_shared<ReflectionService>(
            pb::DescriptorPool::generated_pool(), si->GetServiceList()))) {
      ATTN_LOG(kWarning) << "grpc.reflection.v1 is not served: the server has one already";
    }
  }
  void Finish(grpc::ServerInitializer* /*si*/) override {}
  void ChangeArguments(const std::string& /*name*/, void* /*value*/) override {}
};

class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->push_back(std::make_unique<ReflectionPlugin>());
  }
};

}  // namespace

ServerReflectionResponse AnswerReflection(const pb::DescriptorPool& pool,
                                          const std::vector<std::string>& services,
                                          const ServerReflectionRequest& request) {
  ServerReflectionResponse response;
  response.set_valid_host(request.host());
  *response.mutable_original_request() = request;
  switch (request.message_request_case()) {
    case ServerReflectionRequest::kFileByFilename:
    case ServerReflectionRequest::kFileContainingSymbol:
    case ServerReflectionRequest::kFileContainingExtension: {
      absl::StatusOr<const pb::FileDescriptor*> file = FindFile(pool, request);
      if (!file.ok()) {
        SetError(file.status(), &response);
        break;
      }
      absl::flat_hash_set<std::string> sent;
      AddFileAndImports(*file, &sent, response.mutable_file_descriptor_response());
      break;
    }
    case ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const pb::Descriptor* type =
          pool.FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        SetError(absl::NotFoundError(absl::StrCat("no message type named '",
                                                  request.all_extension_numbers_of_type(), "'")),
                 &response);
        break;
      }
      std::vector<const pb::FieldDescriptor*> extensions;
      pool.FindAllExtensions(type, &extensions);
      std::vector<int> numbers;
      for (const pb::FieldDescriptor* extension : extensions)
        numbers.push_back(extension->number());
      std::sort(numbers.begin(), numbers.end());
      auto* out = response.mutable_all_extension_numbers_response();
      out->set_base_type_name(type->full_name());
      out->mutable_extension_number()->Add(numbers.begin(), numbers.end());
      break;
    }
    case ServerReflectionRequest::kListServices:
      for (const std::string& service : services) {
        response.mutable_list_services_response()->add_service()->set_name(service);
      }
      break;
    case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
      SetError(absl::InvalidArgumentError("message_request: none of its fields is set"), &response);
      break;
  }
  return response;
}

grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse>*
ReflectionService::ServerReflectionInfo(grpc::CallbackServerContext* /*context*/) {
  return new ReflectionReactor(pool_, services_);
}

void AddReflectionService(grpc::ServerBuilder* builder) {
  builder->SetOption(std::make_unique<ReflectionOption>());
}

}  // namespace attnserve
