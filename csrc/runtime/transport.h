// Transport: the communication side of the executor.
//
// NOTE [Transport ordering]: matching is by order alone, as NCCL p2p requires:
// on each directed rank channel a -> b, the k-th send posted by
// a delivers to the k-th receive posted by b. The lowering guarantees both
// sides post in the same order (NOTE [Channel order] in core/lowering.h); the
// key is passed along so an implementation can check or label it, never to
// match on it. Implementations: C10dTransport (c10d ProcessGroup: gloo on CPU,
// NCCL on GPU) and MemoryTransport (threads in one process, for tests).
#pragma once

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "runtime/value.h"

namespace mpmd::runtime {

// A transfer failed or timed out; peer() is the rank at the other end.
class TransportError : public std::runtime_error {
 public:
  TransportError(int peer, const std::string& what) : std::runtime_error(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

// A posted send or receive. Owned by the executor; destroying one that has
// not completed is allowed only when the step is failing anyway.
class PendingTransfer {
 public:
  virtual ~PendingTransfer() = default;
  // Blocks until the transfer completed or `timeout` passed. Returns the
  // received values (empty for a send). Throws TransportError on failure or
  // timeout. Called at most once; may be called without the Python GIL.
  virtual Values wait(std::chrono::milliseconds timeout) = 0;
  // Non-blocking: true once the transfer completed (a later wait() returns at
  // once). Throws TransportError if it failed.
  virtual bool poll() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Starts sending `values` to rank `peer`; does not block. The transport
  // keeps the values alive until the transfer completes.
  virtual std::unique_ptr<PendingTransfer> send(int peer, const TransferKey& key,
                                                Values values) = 0;
  // Posts the receive of the values of `key` from rank `peer`; does not block.
  virtual std::unique_ptr<PendingTransfer> recv(int peer, const TransferKey& key) = 0;
  // Starts sending a stand-in for the values of `key` to `peer`: what a rank
  // whose own step failed sends so that the peer, which waits for these
  // values, can finish its step (NOTE [Draining a failed step] in
  // executor.h). Does not block. Returns nullptr when the transport has no
  // stand-ins (the executor then aborts instead).
  virtual std::unique_ptr<PendingTransfer> sendStandIn(int /*peer*/, const TransferKey& /*key*/) {
    return nullptr;
  }
  // This rank failed: make peers that wait on it fail soon instead of at
  // their timeout, where the transport can. Never throws.
  virtual void abort(const std::string& /*reason*/) noexcept {}
};

}  // namespace mpmd::runtime
