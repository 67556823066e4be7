// The extension's own TypeError: raised by its argument checks (a DLPack dtype
// that is no dsaib::DType, an unknown keyword option, a workspace that is not
// callable) where the library, whose dsaib::Error carries no Python type, has
// no word for it. The module's exception translator (dsaib_ext.cpp) turns it
// into Python's TypeError with the message unchanged.
#pragma once

#include <string>

namespace dsaib_py {

struct PyTypeError {
  std::string message;
};

}  // namespace dsaib_py
