// Where the job's store listens (issue 47, item 6).
//
// Note [Store listen address]: the store listened on every interface, so
// whatever reached the machine on any network could talk to it. It now
// listens on the master address alone when that is one of this machine's:
// MASTER_ADDR / --master-addr as a numeric IPv4 address is used as it is
// ("localhost" is 127.0.0.1); a host name is resolved, except that a name
// resolving to a loopback address while other machines must connect (the
// Debian /etc/hosts line "127.0.1.1 <hostname>") and a name that does not
// resolve, or an IPv6 address (the store is IPv4), listen on every interface
// as before (the job secret still guards it: Note [Store job secret]).
#pragma once

#include <string>

namespace chorus::dist {

// The IPv4 address to listen on for `master_addr`; `other_machines`: ranks
// on other machines will connect.
std::string store_listen_address(const std::string& master_addr, bool other_machines);
// What the store's own host connects to: the listen address (loopback for 0.0.0.0).
std::string store_connect_address(const std::string& listen_addr);

}  // namespace chorus::dist
