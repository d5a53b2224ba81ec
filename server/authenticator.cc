#include "server/authenticator.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attnserve {
namespace {

constexpr absl::string_view kBearer = "Bearer ";
constexpr size_t kMaxIdentityLength = 128;

bool ValidIdentity(absl::string_view name) {
  if (name.empty() || name.size() > kMaxIdentityLength) return false;
  for (const char c : name) {
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                    c == '-' || c == '@';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

Authenticator::Digest Authenticator::Sha256(absl::string_view bytes) {
  Digest digest{};
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest.data());
  return digest;
}

absl::StatusOr<std::vector<Authenticator::Entry>> Authenticator::Parse(absl::string_view text,
                                                                       absl::string_view source) {
  std::vector<Entry> entries;
  std::set<std::string> identities;
  std::set<Digest> digests;
  int line_number = 0;
  int bare_line = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    const std::string where = absl::StrCat(source, ":", line_number);
    Entry entry;
    absl::string_view token;
    if (fields.size() == 1) {
      entry.identity = "default";
      token = fields[0];
      bare_line = line_number;
    } else if (fields.size() == 2) {
      if (!ValidIdentity(fields[0])) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": identity '", fields[0],
                                                       "' must be 1 to ", kMaxIdentityLength,
                                                       " letters, digits or '.', '_', '-', '@'"));
      }
      entry.identity = std::string(fields[0]);
      token = fields[1];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected 'identity token', got ", fields.size(), " fields"));
    }
    if (token.size() < 8) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token is shorter than 8 characters"));
    }
    entry.digest = Sha256(token);
    if (!identities.insert(entry.identity).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": identity '", entry.identity, "' appears twice"));
    }
    if (!digests.insert(entry.digest).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": this token is already given to another identity"));
    }
    entries.push_back(std::move(entry));
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": holds no token"));
  }
  if (bare_line != 0 && entries.size() > 1) {
    // A bare token beside named ones would silently become "default": say so instead.
    return absl::InvalidArgumentError(
        absl::StrCat(source, ":", bare_line,
                     ": a bare token is only accepted as the file's one entry; "
                     "write 'identity token'"));
  }
  return entries;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(const std::string& path) {
  std::unique_ptr<Authenticator> auth(new Authenticator(path));
  absl::StatusOr<int> loaded = auth->Reload();
  if (!loaded.ok()) return loaded.status();
  return auth;
}

absl::StatusOr<int> Authenticator::Reload() {
  std::ifstream in(path_, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth_token_file: cannot read '", path_, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<std::vector<Entry>> entries = Parse(text.str(), path_);
  if (!entries.ok()) return entries.status();
  const int count = static_cast<int>(entries->size());
  absl::MutexLock lock(&mu_);
  entries_ = *std::move(entries);
  return count;
}

bool Authenticator::required() const { return !path_.empty(); }

absl::StatusOr<Identity> Authenticator::Authenticate(const absl::string_view* authorization) const {
  if (!required()) return Identity{};
  const absl::Status refused = absl::UnauthenticatedError(
      "authorization: missing or unknown bearer token (metadata 'authorization: Bearer ...')");
  if (authorization == nullptr || !absl::StartsWith(*authorization, kBearer)) return refused;
  const Digest presented = Sha256(authorization->substr(kBearer.size()));
  absl::MutexLock lock(&mu_);
  const Entry* match = nullptr;
  for (const Entry& entry : entries_) {
    // Every entry is compared in full; only the result selects.
    const bool same = CRYPTO_memcmp(entry.digest.data(), presented.data(), presented.size()) == 0;
    if (same) match = &entry;
  }
  if (match == nullptr) return refused;
  return Identity{match->identity};
}

}  // namespace attnserve
