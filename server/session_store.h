// KV sessions: a sequence's keys and values kept in a KvPagePool across requests, so that a
// decode step carries its query rows and one token's K/V instead of the whole context.
//
// A session has an owner (the identity that created it: to everyone else its id does not exist),
// a geometry (dtype, KV heads, head_dim), a device (the pool it lives in, chosen at creation as
// the least loaded), its pages (in order: block j holds tokens [j * page_tokens, (j + 1) *
// page_tokens)) and the count of tokens committed. Appends are all-or-nothing: a SessionAppend
// allocates pages and writes rows past the committed tokens, and only Commit makes them part of
// the session; an append that fails or is dropped frees what it took and leaves the session as
// it was. One append is open on a session at a time. Readers take a snapshot (tokens and pages)
// and keep the session alive while they use it, so deleting or expiring a session never pulls
// pages from under a running step: they return to the pool with the last reference.
//
// Idle sessions expire after their TTL (nothing queued or running, no append open, no use for
// that long); nothing else ever evicts a session.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "attn/dtype.h"
#include "server/identity.h"
#include "server/kv_page_pool.h"

namespace attnserve {

struct SessionSpec {
  attn::DType dtype = attn::DType::kBF16;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t max_tokens = 0;                     // 0: the store's default
  absl::Duration ttl = absl::ZeroDuration();  // 0: the store's default
};

class Session {
 public:
  Session(std::string id, Identity owner, const SessionSpec& spec, int page_tokens, int device_slot,
          KvPagePool* pool);
  ~Session();  // the pages go back to the pool
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  const Identity& owner() const { return owner_; }
  attn::DType dtype() const { return spec_.dtype; }
  int num_kv_heads() const { return spec_.num_kv_heads; }
  int head_dim() const { return spec_.head_dim; }
  int64_t max_tokens() const { return spec_.max_tokens; }
  absl::Duration ttl() const { return spec_.ttl; }
  int page_tokens() const { return page_tokens_; }
  int device_slot() const { return device_slot_; }
  KvPagePool& pool() const { return *pool_; }
  absl::Time created() const { return created_; }
  // Elements of one token of every KV head (a row of a page's K or V block).
  int64_t row_elements() const { return int64_t{spec_.num_kv_heads} * spec_.head_dim; }
  int64_t row_bytes() const { return row_elements() * attn::DTypeSize(spec_.dtype); }

  // What a reader sees: the committed tokens and the pages that hold them.
  struct Snapshot {
    int64_t tokens = 0;
    std::vector<int32_t> pages;
  };
  Snapshot Read() const;
  int64_t tokens() const;
  int64_t pages() const;
  absl::Time last_used() const;
  void Touch();

  // Work queued or running for the session (expiry leaves it alone while any is).
  void BeginUse() { uses_.fetch_add(1); }
  void EndUse();
  bool idle(absl::Time now) const;

  // Deleted by its owner: steps already running finish, an open append ends NOT_FOUND, and
  // the pages go back when the last use ends.
  void MarkDeleted();
  bool deleted() const;

 private:
  friend class SessionAppend;

  const std::string id_;
  const Identity owner_;
  const SessionSpec spec_;
  const int page_tokens_;
  const int device_slot_;
  KvPagePool* const pool_;
  const absl::Time created_;
  std::atomic<int> uses_{0};

  mutable absl::Mutex mu_;
  int64_t tokens_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int32_t> pages_ ABSL_GUARDED_BY(mu_);
  absl::Time last_used_ ABSL_GUARDED_BY(mu_);
  bool append_open_ ABSL_GUARDED_BY(mu_) = false;
  bool deleted_ ABSL_GUARDED_BY(mu_) = false;
};

// Keeps a session in use (see Session::BeginUse) for as long as it lives.
class SessionUse {
 public:
  SessionUse() = default;
  explicit SessionUse(std::shared_ptr<Session> session);
  ~SessionUse();
  SessionUse(SessionUse&& other) noexcept = default;
  SessionUse& operator=(SessionUse&& other) noexcept;
  Session* get() const { return session_.get(); }
  Session* operator->() const { return session_.get(); }
  const std::shared_ptr<Session>& shared() const { return session_; }

 private:
  std::shared_ptr<Session> session_;
};

// One all-or-nothing append of tokens at the end of a session (see the file comment).
class SessionAppend {
 public:
  // FAILED_PRECONDITION when another append is open on the session.
  static absl::StatusOr<std::unique_ptr<SessionAppend>> Open(std::shared_ptr<Session> session);
  ~SessionAppend();  // aborts unless committed: the pages it took go back to the pool
  SessionAppend(const SessionAppend&) = delete;
  SessionAppend& operator=(const SessionAppend&) = delete;

  // Where `tokens` more rows go: one span per (page, run of rows). Pages are allocated here,
  // all or none (RESOURCE_EXHAUSTED when the pool is short, FAILED_PRECONDITION past the
  // session's max_tokens, NOT_FOUND once the session is deleted).
  struct RowSpan {
    int64_t first_row;  // among the rows this call adds
    int64_t rows;
    int64_t k_offset;  // bytes from the pool's base to the first K row; V follows at v_offset
    int64_t v_offset;
  };
  absl::StatusOr<std::vector<RowSpan>> Extend(int64_t tokens);

  // The session as it will be once committed: its tokens and every page, new ones included.
  Session::Snapshot Pending() const;
  int64_t appended() const { return written_; }
  Session& session() const { return *session_; }

  // NOT_FOUND, committing nothing, when the session was deleted meanwhile.
  absl::Status Commit();

 private:
  SessionAppend(std::shared_ptr<Session> session, int64_t base, std::vector<int32_t> pages);

  const std::shared_ptr<Session> session_;
  const int64_t base_;            // committed tokens when it opened
  std::vector<int32_t> pages_;    // the session's pages then, and the ones taken since
  const size_t committed_pages_;  // how many of pages_ were the session's
  int64_t written_ = 0;
  bool committed_ = false;
};

class SessionStore {
 public:
  struct Options {
    int64_t page_bytes = 128 << 10;
    int64_t max_tokens = 1 << 20;  // default and largest max_tokens
    absl::Duration default_ttl = absl::Minutes(10);
    int max_sessions_per_identity = 1024;
    absl::Duration expiry_interval = absl::Seconds(1);
  };
  // Hooks the metrics take (any may be empty).
  struct Events {
    std::function<void(const Session&)> created, deleted, expired;
    std::function<void()> tick;  // every expiry interval (the metrics sample the pools)
  };

  // One pool per device slot; the store owns none of them.
  SessionStore(const Options& options, std::vector<KvPagePool*> pools, Events events = {});
  ~SessionStore();  // stops the expiry thread

  // INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED past the identity's session count.
  absl::StatusOr<std::shared_ptr<Session>> Create(const Identity& owner, const SessionSpec& spec);
  // NOT_FOUND for an unknown id and for another identity's session alike.
  absl::StatusOr<std::shared_ptr<Session>> Get(const Identity& owner, const std::string& id) const;
  std::vector<std::shared_ptr<Session>> List(const Identity& owner) const;
  absl::Status Delete(const Identity& owner, const std::string& id);
  // Removes sessions idle past their TTL; returns how many. The expiry thread calls it.
  int ExpireIdle(absl::Time now);

  int open() const;
  const Options& options() const { return options_; }
  const std::vector<KvPagePool*>& pools() const { return pools_; }
  // Tokens a page holds for a geometry: the largest power of two whose K and V blocks fit.
  int PageTokens(attn::DType dtype, int num_kv_heads, int head_dim) const;

 private:
  void ExpiryLoop();

  const Options options_;
  const std::vector<KvPagePool*> pools_;
  const Events events_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<Identity, int> per_owner_ ABSL_GUARDED_BY(mu_);
  absl::Notification stopping_;
  std::thread expiry_;
};

}  // namespace attnserve
