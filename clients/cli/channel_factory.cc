#include "clients/cli/channel_factory.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "proto/wire/channel_args.h"

namespace attnserve::client {

absl::StatusOr<std::shared_ptr<grpc::Channel>> ChannelFactory::Connect() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
  // Each channel gets its own connection, so that a load generator with several channels is
  // not limited to one HTTP/2 connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  absl::StatusOr<std::vector<ChannelArg>> extra = ParseChannelArgs(options_.grpc_args, "grpc_arg");
  if (!extra.ok()) return extra.status();
  for (const ChannelArg& arg : *extra) {
    if (const int* number = std::get_if<int>(&arg.value)) {
      args.SetInt(arg.name, *number);
    } else {
      args.SetString(arg.name, std::get<std::string>(arg.value));
    }
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (!options_.tls_ca_file.empty()) {
    std::ifstream in(options_.tls_ca_file);
    if (!in) {
      return absl::NotFoundError(
          absl::StrCat("--tls_ca_file: cannot read '", options_.tls_ca_file, "'"));
    }
    std::ostringstream pem;
    pem << in.rdbuf();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.str();
    credentials = grpc::SslCredentials(ssl);
    if (!options_.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options_.tls_server_name);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  return grpc::CreateCustomChannel(options_.target, credentials, args);
}

void ChannelFactory::Prepare(grpc::ClientContext* context, absl::Duration timeout) const {
  if (!options_.auth_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
  }
  if (timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
}

}  // namespace attnserve::client
