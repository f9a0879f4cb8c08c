// The subcommands of the `chorus` program.
#pragma once

#include <string>

namespace chorus::app {

std::string version_text();
int run_devices();

}  // namespace chorus::app
