// Who made a call: the identity its bearer token names (server/authenticator.h). What a call
// creates (shared-memory regions, sessions, training jobs) belongs to its identity.
#pragma once

#include <string>

namespace attnserve {

// With no token file every caller is the same, anonymous identity (an empty name).
struct Identity {
  std::string name;
  bool operator==(const Identity& other) const { return name == other.name; }
  bool operator<(const Identity& other) const { return name < other.name; }
};

}  // namespace attnserve
