// Requests and answers as gRPC bytes. The indexer services take their methods' messages as raw
// ByteBuffers and parse them here, so that a request that does not parse is answered with
// INVALID_ARGUMENT saying so (gRPC's own generated handlers answer an opaque error), and so that
// the hot calls parse into and answer from one arena per call.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>
#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace indexer::server {

// Parses `bytes` into *out. INVALID_ARGUMENT naming the message type when they do not parse
// (malformed or truncated bytes, or a string field that is not valid UTF-8, such as a
// sequence_id a C++ client filled with raw bytes).
template <typename Message>
absl::Status ParseMessage(const grpc::ByteBuffer& bytes, Message* out) {
  // The reader only reads; it takes a non-const buffer for gRPC's C API.
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(&bytes));
  if (out->ParseFromZeroCopyStream(&reader)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the request is not a valid ", out->GetTypeName(),
      ": its bytes do not parse (malformed or truncated, or a string field such as sequence_id "
      "that is not valid UTF-8)"));
}

// Serializes `message` into *out (replacing what it held), as one slice.
template <typename Message>
void SerializeMessage(const Message& message, grpc::ByteBuffer* out) {
  const size_t size = message.ByteSizeLong();
  grpc::Slice slice(size);
  message.SerializeWithCachedSizesToArray(const_cast<uint8_t*>(slice.begin()));
  grpc::ByteBuffer bytes(&slice, 1);
  out->Swap(&bytes);
}

}  // namespace indexer::server
