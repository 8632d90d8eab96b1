// Helpers for tests that check error messages. Header-only and torch-free.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

namespace mfsdp::testing {

// The message of the exception `f` throws, or "<no exception>".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

// Every one of `parts` occurs in `text`.
inline void expect_contains(const std::string& text, std::initializer_list<std::string> parts) {
  for (const auto& part : parts)
    EXPECT_NE(text.find(part), std::string::npos) << "expected \"" << part << "\" in: " << text;
}

}  // namespace mfsdp::testing
