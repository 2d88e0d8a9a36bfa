// Status: the error type every launcher and reference returns.
//
// No exception crosses the C ABI: code below csrc/ffi/ returns a Status, and the
// FFI layer turns a failed one into an xla::ffi::Error. Messages name the op, the
// argument and what was expected, e.g. "lowbit_amax: x: expected a float type, got s32".
#pragma once

#include <string>
#include <utility>

namespace lowbit {

enum class StatusCode { kOk = 0, kInvalidArgument, kUnimplemented, kInternal };

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return Status(StatusCode::kInvalidArgument, std::move(msg));
  }
  static Status Unimplemented(std::string msg) {
    return Status(StatusCode::kUnimplemented, std::move(msg));
  }
  static Status Internal(std::string msg) { return Status(StatusCode::kInternal, std::move(msg)); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string msg) : code_(code), message_(std::move(msg)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace lowbit

// Returns early from the enclosing function when `expr` yields a failed Status.
#define LOWBIT_RETURN_IF_ERROR(expr)          \
  do {                                        \
    ::lowbit::Status _lowbit_status = (expr); \
    if (!_lowbit_status.ok()) return _lowbit_status; \
  } while (0)
