// Bearer-token identities. Every AttentionService call presents "authorization: Bearer <token>";
// the token names an identity, and what a call creates (shared-memory regions, sessions,
// training jobs) belongs to that identity: other identities get NOT_FOUND for it.
//
// The token file holds one "identity token" pair per line ('#' starts a comment line; a file
// whose only entry is a bare token names the identity "default"). SIGHUP re-reads it (main.cc):
// a file that no longer parses keeps the table in force and says why.
//
// Tokens are compared through their SHA-256 digests, against every entry, without an early exit:
// neither the length nor a matching prefix of a token shows in the time a call takes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/identity.h"

namespace attnserve {

class Authenticator {
 public:
  using Digest = std::array<uint8_t, 32>;
  struct Entry {
    std::string identity;
    Digest digest;
  };

  // No tokens: every call is accepted as the anonymous identity.
  Authenticator() = default;
  // Reads `path`; INVALID_ARGUMENT / NOT_FOUND naming the line that is wrong.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& path);
  // The entries of a token file's text (`source` names it in errors).
  static absl::StatusOr<std::vector<Entry>> Parse(absl::string_view text, absl::string_view source);

  // Re-reads the file; on error the current table stays in force. Returns the entry count.
  absl::StatusOr<int> Reload();

  bool required() const;
  // The identity of an "authorization" metadata value (null: the call sent none), or
  // UNAUTHENTICATED.
  absl::StatusOr<Identity> Authenticate(const absl::string_view* authorization) const;

  static Digest Sha256(absl::string_view bytes);

 private:
  explicit Authenticator(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
