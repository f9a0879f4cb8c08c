// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the store's job secret
// (Note [Store job secret] in distributed/store_auth.h).
//
// Note [Own SHA-256]: the proof a store client gives is one HMAC per
// connection; a hundred lines here cost less than an optional dependency on
// OpenSSL's libcrypto (present on some machines, absent on others) with a
// fallback that would be this code anyway. Checked against FIPS 180-2's and
// RFC 4231's test vectors (tests/distributed/store_auth_test.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace chorus::dist {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t n);
Digest hmac_sha256(std::string_view key, const void* data, size_t n);
// Compares in time independent of where they differ (a MAC check must not
// tell a guesser how many leading bytes were right).
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace chorus::dist
