// AnswerReflection (grpc.reflection.v1) on every kind of request: against the generated pool for
// the server's own files, and against a small pool of proto2 files for imports and extensions.
#include "server/reflection_service.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/text_format.h"
#include "grpc/health/v1/health.pb.h"

namespace attnserve {
namespace {

namespace pb = google::protobuf;
using grpc::reflection::v1::ServerReflectionRequest;
using grpc::reflection::v1::ServerReflectionResponse;

std::vector<pb::FileDescriptorProto> Files(const ServerReflectionResponse& response) {
  std::vector<pb::FileDescriptorProto> files;
  for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
    EXPECT_TRUE(files.emplace_back().ParseFromString(bytes));
  }
  return files;
}

std::vector<std::string> Names(const std::vector<pb::FileDescriptorProto>& files) {
  std::vector<std::string> names;
  for (const auto& file : files) names.push_back(file.name());
  return names;
}

ServerReflectionRequest SymbolRequest(const std::string& symbol) {
  ServerReflectionRequest request;
  request.set_host("localhost:50051");
  request.set_file_containing_symbol(symbol);
  return request;
}

// base.proto declares an extendable message; ext.proto imports it and extends it; top.proto
// imports both (a diamond: base.proto must be sent once).
class ReflectionPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* text : {
             R"pb(name: "t/base.proto"
                  package: "t"
                  message_type {
                    name: "Base"
                    extension_range { start: 100 end: 200 }
                  })pb",
             R"pb(name: "t/ext.proto"
                  package: "t"
                  dependency: "t/base.proto"
                  extension {
                    name: "second"
                    number: 151
                    label: LABEL_OPTIONAL
                    type: TYPE_INT32
                    extendee: ".t.Base"
                  }
                  extension {
                    name: "first"
                    number: 150
                    label: LABEL_OPTIONAL
                    type: TYPE_STRING
                    extendee: ".t.Base"
                  })pb",
             R"pb(name: "t/top.proto"
                  package: "t"
                  dependency: "t/ext.proto"
                  dependency: "t/base.proto"
                  message_type { name: "Top" }
                  service {
                    name: "TopService"
                    method { name: "Get" input_type: ".t.Top" output_type: ".t.Base" }
                  })pb"}) {
      pb::FileDescriptorProto file;
      ASSERT_TRUE(pb::TextFormat::ParseFromString(text, &file));
      ASSERT_NE(pool_.BuildFile(file), nullptr) << file.name();
    }
  }

  ServerReflectionResponse Answer(const ServerReflectionRequest& request) {
    return AnswerReflection(pool_, {"t.TopService"}, request);
  }

  pb::DescriptorPool pool_;
};

TEST(ReflectionServiceTest, ListsTheServicesItIsGiven) {
  const std::vector<std::string> services = {"attnserve.v1.AttentionService",
                                             "grpc.health.v1.Health"};
  ServerReflectionRequest request;
  request.set_list_services("");
  const ServerReflectionResponse response =
      AnswerReflection(*pb::DescriptorPool::generated_pool(), services, request);
  ASSERT_TRUE(response.has_list_services_response());
  std::vector<std::string> listed;
  for (const auto& service : response.list_services_response().service()) {
    listed.push_back(service.name());
  }
  EXPECT_EQ(listed, services);
}

TEST(ReflectionServiceTest, DescribesTheServerProtosFromTheGeneratedPool) {
  // A generated file is in the pool only when its code is linked; the server links these the same
  // way (nothing else in this binary refers to them).
  v1::AttendRequest::descriptor();
  grpc::health::v1::HealthCheckRequest::descriptor();
  for (const char* symbol :
       {"attnserve.v1.AttentionService", "attnserve.v1.AttentionService.Attend",
        "attnserve.v1.AttendRequest", "attnserve.v1.DType", "grpc.reflection.v1.ServerReflection",
        "grpc.health.v1.Health"}) {
    const ServerReflectionRequest request = SymbolRequest(symbol);
    const ServerReflectionResponse response =
        AnswerReflection(*pb::DescriptorPool::generated_pool(), {}, request);
    EXPECT_EQ(response.valid_host(), "localhost:50051");
    EXPECT_EQ(response.original_request().file_containing_symbol(), symbol);
    const std::vector<pb::FileDescriptorProto> files = Files(response);
    ASSERT_FALSE(files.empty()) << symbol << ": " << response.ShortDebugString();
    EXPECT_TRUE(std::string(symbol).rfind(files[0].package() + ".", 0) == 0)
        << symbol << " in " << files[0].name();
  }
}

TEST_F(ReflectionPoolTest, SendsAFileThenEachFileItImportsOnce) {
  ServerReflectionRequest request;
  request.set_file_by_filename("t/top.proto");
  EXPECT_EQ(Names(Files(Answer(request))),
            (std::vector<std::string>{"t/top.proto", "t/ext.proto", "t/base.proto"}));
  EXPECT_EQ(Names(Files(Answer(SymbolRequest("t.TopService.Get")))),
            (std::vector<std::string>{"t/top.proto", "t/ext.proto", "t/base.proto"}));
  EXPECT_EQ(Names(Files(Answer(SymbolRequest("t.Base")))),
            (std::vector<std::string>{"t/base.proto"}));
}

TEST_F(ReflectionPoolTest, FindsExtensions) {
  ServerReflectionRequest request;
  request.mutable_file_containing_extension()->set_containing_type("t.Base");
  request.mutable_file_containing_extension()->set_extension_number(150);
  EXPECT_EQ(Names(Files(Answer(request))),
            (std::vector<std::string>{"t/ext.proto", "t/base.proto"}));

  request.Clear();
  request.set_all_extension_numbers_of_type("t.Base");
  const ServerReflectionResponse numbers = Answer(request);
  EXPECT_EQ(numbers.all_extension_numbers_response().base_type_name(), "t.Base");
  EXPECT_EQ(std::vector<int>(numbers.all_extension_numbers_response().extension_number().begin(),
                             numbers.all_extension_numbers_response().extension_number().end()),
            (std::vector<int>{150, 151}));
}

TEST_F(ReflectionPoolTest, AnswersWhatItCannotFindWithNotFound) {
  std::vector<ServerReflectionRequest> requests(5);
  requests[0].set_file_by_filename("t/missing.proto");
  requests[1].set_file_containing_symbol("t.Missing");
  requests[2].mutable_file_containing_extension()->set_containing_type("t.Base");
  requests[2].mutable_file_containing_extension()->set_extension_number(199);
  requests[3].mutable_file_containing_extension()->set_containing_type("t.Missing");
  requests[4].set_all_extension_numbers_of_type("t.Missing");
  for (const ServerReflectionRequest& request : requests) {
    const ServerReflectionResponse response = Answer(request);
    ASSERT_TRUE(response.has_error_response()) << request.ShortDebugString();
    EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_FALSE(response.error_response().error_message().empty());
  }
  const ServerReflectionResponse empty = Answer(ServerReflectionRequest());
  EXPECT_EQ(empty.error_response().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace attnserve
