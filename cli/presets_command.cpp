// `dsaib presets`: the presets of the generation flags, one a line.
#include <iostream>

#include "commands.hpp"

namespace dsaib::cli {

PresetsCommand::PresetsCommand(CLI::App& app) { cmd_ = app.add_subcommand("presets", "list the presets"); }

int PresetsCommand::run() {
  for (const auto& [name, desc] : preset_list()) std::cout << name << ": " << desc << "\n";
  return 0;
}

}  // namespace dsaib::cli
