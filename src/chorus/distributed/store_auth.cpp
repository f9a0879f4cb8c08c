#include "chorus/distributed/store_auth.h"

#include <cstring>
#include <string_view>
#include <vector>

#include "chorus/distributed/hmac_sha256.h"
#include "chorus/distributed/job_secret.h"

namespace chorus::dist {

namespace {

// Note [Store job secret]: the two MACs carry different labels, so neither
// side's answer can be played back as the other's.
Digest handshake_mac(const std::string& secret, std::string_view label, const Nonce& cn, const Nonce& sn) {
  std::string msg(label);
  msg.append(reinterpret_cast<const char*>(cn.data()), cn.size());
  msg.append(reinterpret_cast<const char*>(sn.data()), sn.size());
  return hmac_sha256(secret, msg.data(), msg.size());
}

template <typename T>
T read_value(Socket& s, Clock::time_point deadline) {
  T v{};
  s.recv_all(&v, sizeof(v), deadline);
  return v;
}

constexpr std::string_view kServerLabel = "chorus-store-server", kClientLabel = "chorus-store-client";

}  // namespace

void prove_job_secret(Socket& s, const std::string& secret, const std::string& address, Clock::time_point deadline) {
  Nonce cn;
  random_bytes(cn.data(), cn.size());
  std::vector<uint8_t> hello{kAuthQuery};
  hello.insert(hello.end(), cn.begin(), cn.end());
  s.send_all(hello.data(), hello.size());
  const auto answer = read_value<uint8_t>(s, deadline);
  CHORUS_CHECK_T(StoreAuthError, answer != kAuthUnneeded, "the store at ", address,
                 " has no job secret but this process was given one (", kJobSecretVariable,
                 "): give the process that serves the store (rank 0, or node 0's chorus launch) the same secret");
  CHORUS_CHECK_T(DistError, answer == kAuthChallenge, "the service at ", address,
                 " is not a Chorus store (wrong answer to the job secret's handshake)");
  const auto sn = read_value<Nonce>(s, deadline);
  const auto server_mac = read_value<Digest>(s, deadline);
  CHORUS_CHECK_T(StoreAuthError, digests_equal(server_mac, handshake_mac(secret, kServerLabel, cn, sn)),
                 "the store at ", address, " was given another job secret than this process: every process and "
                 "every node's chorus launch of one job needs the same ", kJobSecretVariable,
                 " (or --job-secret-file)");
  const Digest mine = handshake_mac(secret, kClientLabel, cn, sn);
  s.send_all(mine.data(), mine.size());
  CHORUS_CHECK_T(StoreAuthError, read_value<uint8_t>(s, deadline) == kAuthAccepted, "the store at ", address,
                 " refused this process's job secret");
}

bool accept_job_secret(Socket& s, const std::string& secret, Clock::time_point deadline) {
  const auto cn = read_value<Nonce>(s, deadline);
  Nonce sn;
  random_bytes(sn.data(), sn.size());
  const Digest server_mac = handshake_mac(secret, kServerLabel, cn, sn);
  std::vector<uint8_t> challenge{kAuthChallenge};
  challenge.insert(challenge.end(), sn.begin(), sn.end());
  challenge.insert(challenge.end(), server_mac.begin(), server_mac.end());
  s.send_all(challenge.data(), challenge.size());
  const auto proof = read_value<Digest>(s, deadline);
  if (!digests_equal(proof, handshake_mac(secret, kClientLabel, cn, sn))) return false;
  const uint8_t ok = kAuthAccepted;
  s.send_all(&ok, 1);
  return true;
}

void throw_secret_required(const std::string& address) {
  CHORUS_THROW(StoreAuthError, "the store at ", address, " requires the job's secret and this process has none: set ",
               kJobSecretVariable, " to the job's secret (chorus launch hands its workers its own)");
}

}  // namespace chorus::dist
