// The store's handshake with a job secret (server and client halves).
//
// Note [Store job secret] (issue 47, item 6): PyTorch's TCPStore lets anyone
// who reaches its port read and write every key; from outside a job, setting
// `world_size` or `job` stopped every rank, `resume_from` made ranks load
// different checkpoints, and `chorus/launch/0/failed` stopped a multi-node
// job on every node. A store with a secret serves only connections that
// prove they know it. After VALIDATE the client sends AUTH (0x43) and a
// 32-byte random nonce cn; the server answers 0 (a challenge), its own
// random nonce sn and HMAC-SHA256(secret, "chorus-store-server" cn sn); the
// client checks that (a store that does not know the secret is not its job's:
// one line, "another job secret") and sends HMAC-SHA256(secret,
// "chorus-store-client" cn sn); the server answers 0 and serves it, or drops
// it. The secret itself never crosses the network, and a listener who saw one
// handshake cannot replay it: the next connection gets another sn. A store
// without a secret answers AUTH with 1 (none here), and a client with a secret
// then refuses it. A store with a secret answers a client that sends anything
// else first (a Chorus or PyTorch client without the secret) by dropping it;
// to a PING it first echoes kAuthRequiredEcho, so a Chorus client can say
// what is missing. What this does not do: encrypt, or protect a connection
// from someone on the path who takes it over after the handshake; jobs across
// untrusted networks still need a private network or a tunnel.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "chorus/core/error.h"
#include "chorus/distributed/socket.h"

namespace chorus {
// The store refused this process's secret, or wanted one it lacks: not
// worth retrying (a store not yet up is a DistError, and is retried).
class StoreAuthError : public DistError {
 public:
  StoreAuthError(const std::string& msg, const char* file, int line) : DistError(msg, file, line) {}
};
}  // namespace chorus

namespace chorus::dist {

inline constexpr uint8_t kAuthQuery = 0x43;
inline constexpr uint8_t kAuthChallenge = 0, kAuthUnneeded = 1;  // the server's first answer
inline constexpr uint8_t kAuthAccepted = 0;                      // its last
// Answer of a store with a secret to a PING before AUTH (a pid never equals it).
inline constexpr uint32_t kAuthRequiredEcho = 0x52515541;  // "AUQR"
using Nonce = std::array<uint8_t, 32>;

// Client: sends AUTH and proves `secret` to the store at `address` (after
// VALIDATE). StoreAuthError, one line, when the store knows another secret or
// none.
void prove_job_secret(Socket& s, const std::string& secret, const std::string& address, Clock::time_point deadline);

// Server: after reading AUTH's type byte, runs the rest of the handshake.
// True when the client proved `secret` (not empty).
bool accept_job_secret(Socket& s, const std::string& secret, Clock::time_point deadline);

// The error a client without a secret throws when the store answers its
// PING with kAuthRequiredEcho.
[[noreturn]] void throw_secret_required(const std::string& address);

}  // namespace chorus::dist
