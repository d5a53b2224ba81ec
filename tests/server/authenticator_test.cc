// Bearer-token identities: the token file's format and its errors, reloading, and that a call
// is let in as exactly the identity its token names.
#include "server/authenticator.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/match.h"

namespace attnserve {
namespace {

std::string WriteFile(const std::string& text) {
  char path[] = "/tmp/attnserve-tokens-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

absl::StatusOr<Identity> Call(const Authenticator& auth, const std::string& header) {
  const absl::string_view value(header);
  return auth.Authenticate(&value);
}

TEST(Authenticator, WithoutTokensEveryCallIsTheAnonymousIdentity) {
  Authenticator open;
  EXPECT_FALSE(open.required());
  auto caller = open.Authenticate(nullptr);
  ASSERT_TRUE(caller.ok());
  EXPECT_EQ(caller->name, "");
}

TEST(Authenticator, TokensNameIdentities) {
  const std::string path = WriteFile(
      "# who may call\n"
      "alice  tok-alice-123\n"
      "\n"
      "bob tok-bob-4567   \n");
  auto auth = Authenticator::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->required());
  EXPECT_EQ(Call(**auth, "Bearer tok-alice-123")->name, "alice");
  EXPECT_EQ(Call(**auth, "Bearer tok-bob-4567")->name, "bob");
  for (const char* wrong : {"Bearer tok-alice-124", "Bearer tok-alice-12", "Bearer ",
                            "tok-alice-123", "Basic tok-alice-123", "Bearer tok-alice-123 "}) {
    EXPECT_EQ(Call(**auth, wrong).status().code(), absl::StatusCode::kUnauthenticated) << wrong;
  }
  EXPECT_EQ((*auth)->Authenticate(nullptr).status().code(), absl::StatusCode::kUnauthenticated);
  std::remove(path.c_str());
}

TEST(Authenticator, ABareTokenIsTheDefaultIdentity) {
  const std::string path = WriteFile("just-one-token\n");
  auto auth = Authenticator::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ(Call(**auth, "Bearer just-one-token")->name, "default");
  std::remove(path.c_str());
}

TEST(Authenticator, FileErrorsNameTheLine) {
  auto expect_error = [](const std::string& text, const std::string& words) {
    auto entries = Authenticator::Parse(text, "tokens");
    ASSERT_FALSE(entries.ok()) << text;
    EXPECT_EQ(entries.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(entries.status().message(), words)) << entries.status();
  };
  expect_error("", "holds no token");
  expect_error("# only a comment\n", "holds no token");
  expect_error("alice tok-alice-1\nalice tok-alice-2\n",
               "tokens:2: identity 'alice' appears twice");
  expect_error("alice tok-same-1\nbob tok-same-1\n", "tokens:2: this token is already given");
  expect_error("alice short\n", "tokens:1: the token is shorter than 8");
  expect_error("al/ice tok-alice-1\n", "tokens:1: identity 'al/ice'");
  expect_error("alice tok-alice-1 extra\n", "tokens:1: expected 'identity token'");
  expect_error("alice tok-alice-1\nbare-token-2\n", "tokens:2: a bare token");
  EXPECT_EQ(Authenticator::FromFile("/nonexistent/tokens").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(Authenticator, ReloadReplacesTheTableOrKeepsIt) {
  const std::string path = WriteFile("alice tok-alice-123\n");
  auto auth = Authenticator::FromFile(path);
  ASSERT_TRUE(auth.ok());
  std::ofstream(path) << "alice tok-alice-new\ncarol tok-carol-123\n";
  auto loaded = (*auth)->Reload();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 2);
  EXPECT_FALSE(Call(**auth, "Bearer tok-alice-123").ok());  // revoked
  EXPECT_EQ(Call(**auth, "Bearer tok-alice-new")->name, "alice");
  EXPECT_EQ(Call(**auth, "Bearer tok-carol-123")->name, "carol");
  // A file that no longer parses leaves the table in force.
  std::ofstream(path) << "carol x\n";
  EXPECT_FALSE((*auth)->Reload().ok());
  EXPECT_EQ(Call(**auth, "Bearer tok-carol-123")->name, "carol");
  std::remove(path.c_str());
}

TEST(Authenticator, DigestIsSha256) {
  // FIPS 180-2's "abc" vector.
  const Authenticator::Digest d = Authenticator::Sha256("abc");
  EXPECT_EQ(d[0], 0xba);
  EXPECT_EQ(d[1], 0x78);
  EXPECT_EQ(d[31], 0xad);
}

}  // namespace
}  // namespace attnserve
