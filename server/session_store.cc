#include "server/session_store.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve {
namespace {

// Past this a page mostly holds a session's unused tail; the paged kernels want >= 128.
constexpr int kMaxPageTokens = 1024;

// 128 random bits as 32 hex digits: not guessable, so ids cannot be probed.
std::string NewSessionId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status NotFound() {
  // The same answer for an unknown id and another identity's session.
  return absl::NotFoundError("session_id: no such session");
}

}  // namespace

Session::Session(std::string id, Identity owner, const SessionSpec& spec, int page_tokens,
                 int device_slot, KvPagePool* pool)
    : id_(std::move(id)),
      owner_(std::move(owner)),
      spec_(spec),
      page_tokens_(page_tokens),
      device_slot_(device_slot),
      pool_(pool),
      created_(absl::Now()),
      last_used_(created_) {}

Session::~Session() { pool_->Free(pages_); }

void Session::MarkDeleted() {
  absl::MutexLock lock(&mu_);
  deleted_ = true;
}

bool Session::deleted() const {
  absl::MutexLock lock(&mu_);
  return deleted_;
}

Session::Snapshot Session::Read() const {
  absl::MutexLock lock(&mu_);
  Snapshot s;
  s.tokens = tokens_;
  s.pages.assign(pages_.begin(), pages_.begin() + static_cast<std::ptrdiff_t>(
                                                      (tokens_ + page_tokens_ - 1) / page_tokens_));
  return s;
}

int64_t Session::tokens() const {
  absl::MutexLock lock(&mu_);
  return tokens_;
}

int64_t Session::pages() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(pages_.size());
}

absl::Time Session::last_used() const {
  absl::MutexLock lock(&mu_);
  return last_used_;
}

void Session::Touch() {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
}

void Session::EndUse() {
  Touch();
  uses_.fetch_sub(1);
}

bool Session::idle(absl::Time now) const {
  if (uses_.load() > 0) return false;
  absl::MutexLock lock(&mu_);
  return !append_open_ && now - last_used_ >= spec_.ttl;
}

SessionUse::SessionUse(std::shared_ptr<Session> session) : session_(std::move(session)) {
  if (session_ != nullptr) session_->BeginUse();
}

SessionUse::~SessionUse() {
  if (session_ != nullptr) session_->EndUse();
}

SessionUse& SessionUse::operator=(SessionUse&& other) noexcept {
  if (this != &other) {
    if (session_ != nullptr) session_->EndUse();
    session_ = std::move(other.session_);
  }
  return *this;
}

absl::StatusOr<std::unique_ptr<SessionAppend>> SessionAppend::Open(
    std::shared_ptr<Session> session) {
  int64_t base = 0;
  std::vector<int32_t> pages;
  {
    absl::MutexLock lock(&session->mu_);
    if (session->append_open_) {
      return absl::FailedPreconditionError(
          "session_id: another append to this session is in progress (AppendKV, or a step "
          "with append); one at a time");
    }
    session->append_open_ = true;
    base = session->tokens_;
    pages = session->pages_;
  }
  return std::unique_ptr<SessionAppend>(
      new SessionAppend(std::move(session), base, std::move(pages)));
}

SessionAppend::SessionAppend(std::shared_ptr<Session> session, int64_t base,
                             std::vector<int32_t> pages)
    : session_(std::move(session)),
      base_(base),
      pages_(std::move(pages)),
      committed_pages_(pages_.size()) {}

SessionAppend::~SessionAppend() {
  if (committed_) return;
  std::vector<int32_t> taken(pages_.begin() + static_cast<std::ptrdiff_t>(committed_pages_),
                             pages_.end());
  session_->pool().Free(taken);
  absl::MutexLock lock(&session_->mu_);
  session_->append_open_ = false;
}

absl::StatusOr<std::vector<SessionAppend::RowSpan>> SessionAppend::Extend(int64_t tokens) {
  Session& s = *session_;
  if (s.deleted()) return NotFound();
  const int64_t end = base_ + written_ + tokens;
  if (end > s.max_tokens()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session_id: the session holds ", base_ + written_, " tokens and takes at most ",
        s.max_tokens(), "; ", tokens, " more do not fit (create it with a larger max_tokens)"));
  }
  const int64_t pt = s.page_tokens();
  const int64_t pages_needed = (end + pt - 1) / pt;
  if (pages_needed > static_cast<int64_t>(pages_.size())) {
    absl::StatusOr<std::vector<int32_t>> more =
        s.pool().Allocate(pages_needed - static_cast<int64_t>(pages_.size()));
    if (!more.ok()) return more.status();
    pages_.insert(pages_.end(), more->begin(), more->end());
  }
  const int64_t row = s.row_bytes();
  const int64_t page_bytes = s.pool().page_bytes();
  std::vector<RowSpan> spans;
  for (int64_t done = 0; done < tokens;) {
    const int64_t t = base_ + written_ + done;
    const int64_t in_page = t % pt;
    const int64_t rows = std::min(tokens - done, pt - in_page);
    const int64_t page = pages_[static_cast<size_t>(t / pt)];
    const int64_t k = page * page_bytes + in_page * row;
    spans.push_back({done, rows, k, k + pt * row});
    done += rows;
  }
  written_ += tokens;
  return spans;
}

Session::Snapshot SessionAppend::Pending() const {
  Session::Snapshot s;
  s.tokens = base_ + written_;
  const int64_t pt = session_->page_tokens();
  s.pages.assign(pages_.begin(),
                 pages_.begin() + static_cast<std::ptrdiff_t>((s.tokens + pt - 1) / pt));
  return s;
}

absl::Status SessionAppend::Commit() {
  absl::MutexLock lock(&session_->mu_);
  if (session_->deleted_) return NotFound();  // the destructor gives the new pages back
  session_->tokens_ = base_ + written_;
  session_->pages_ = pages_;
  session_->append_open_ = false;
  session_->last_used_ = absl::Now();
  committed_ = true;
  return absl::OkStatus();
}

SessionStore::SessionStore(const Options& options, std::vector<KvPagePool*> pools, Events events)
    : options_(options), pools_(std::move(pools)), events_(std::move(events)) {
  expiry_ = std::thread([this] { ExpiryLoop(); });
}

SessionStore::~SessionStore() {
  stopping_.Notify();
  if (expiry_.joinable()) expiry_.join();
}

int SessionStore::PageTokens(attn::DType dtype, int num_kv_heads, int head_dim) const {
  const int64_t block_pair = 2 * int64_t{num_kv_heads} * head_dim * attn::DTypeSize(dtype);
  int tokens = 0;
  for (int t = 1; t <= kMaxPageTokens && t * block_pair <= options_.page_bytes; t *= 2) {
    tokens = t;
  }
  return tokens;
}

absl::StatusOr<std::shared_ptr<Session>> SessionStore::Create(const Identity& owner,
                                                              const SessionSpec& requested) {
  SessionSpec spec = requested;
  if (spec.num_kv_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads: must be >= 1, got ", spec.num_kv_heads));
  }
  if (spec.head_dim < 1 || spec.head_dim > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim: must be in [1, 256], got ", spec.head_dim));
  }
  if (spec.max_tokens < 0 || spec.max_tokens > options_.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: must be in [0, ",
                                                   options_.max_tokens, "], got ", spec.max_tokens,
                                                   " (0: the default)"));
  }
  if (spec.ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ttl_seconds: must be >= 0 (0: the default)");
  }
  if (spec.max_tokens == 0) spec.max_tokens = options_.max_tokens;
  if (spec.ttl == absl::ZeroDuration()) spec.ttl = options_.default_ttl;
  const int page_tokens = PageTokens(spec.dtype, spec.num_kv_heads, spec.head_dim);
  if (page_tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_kv_heads: one token of ", spec.num_kv_heads, " KV heads x head_dim ", spec.head_dim,
        " does not fit in a page of ", options_.page_bytes, " bytes (--kv_page_bytes)"));
  }
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    int& count = per_owner_[owner];
    if (count >= options_.max_sessions_per_identity) {
      return absl::ResourceExhaustedError(absl::StrCat("session: this identity holds ", count,
                                                       " sessions, its limit; delete some"));
    }
    // The least loaded device takes it: the most free KV bytes, then the fewest sessions, since
    // sessions created before their first append hold no pages and would otherwise all land on
    // the first device. Chosen under the lock, so that concurrent creations see each other.
    std::vector<int> held(pools_.size(), 0);
    for (const auto& [id, held_session] : sessions_) {
      ++held[static_cast<size_t>(held_session->device_slot())];
    }
    size_t slot = 0;
    int64_t best_free = -1;
    for (size_t i = 0; i < pools_.size(); ++i) {
      const int64_t free = pools_[i]->free_pages() * pools_[i]->page_bytes();
      if (free > best_free || (free == best_free && held[i] < held[slot])) {
        best_free = free;
        slot = i;
      }
    }
    session = std::make_shared<Session>(NewSessionId(), owner, spec, page_tokens,
                                        static_cast<int>(slot), pools_[slot]);
    ++count;
    sessions_[session->id()] = session;
  }
  if (events_.created) events_.created(*session);
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionStore::Get(const Identity& owner,
                                                           const std::string& id) const {
  absl::MutexLock lock(&mu_);
  const auto it = sessions_.find(id);
  if (it == sessions_.end() || !(it->second->owner() == owner)) return NotFound();
  return it->second;
}

std::vector<std::shared_ptr<Session>> SessionStore::List(const Identity& owner) const {
  std::vector<std::shared_ptr<Session>> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, session] : sessions_) {
    if (session->owner() == owner) out.push_back(session);
  }
  return out;
}

absl::Status SessionStore::Delete(const Identity& owner, const std::string& id) {
  std::shared_ptr<Session> removed;
  {
    absl::MutexLock lock(&mu_);
    const auto it = sessions_.find(id);
    if (it == sessions_.end() || !(it->second->owner() == owner)) return NotFound();
    removed = std::move(it->second);
    sessions_.erase(it);
    if (--per_owner_[owner] <= 0) per_owner_.erase(owner);
  }
  removed->MarkDeleted();
  if (events_.deleted) events_.deleted(*removed);
  return absl::OkStatus();  // its pages go back once the last step using it is done
}

int SessionStore::ExpireIdle(absl::Time now) {
  std::vector<std::shared_ptr<Session>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (it->second->idle(now)) {
        if (--per_owner_[it->second->owner()] <= 0) per_owner_.erase(it->second->owner());
        expired.push_back(std::move(it->second));
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (events_.expired) {
    for (const auto& session : expired) events_.expired(*session);
  }
  return static_cast<int>(expired.size());
}

int SessionStore::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

void SessionStore::ExpiryLoop() {
  while (!stopping_.WaitForNotificationWithTimeout(options_.expiry_interval)) {
    ExpireIdle(absl::Now());
    if (events_.tick) events_.tick();
  }
}

}  // namespace attnserve
