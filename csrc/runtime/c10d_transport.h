// C10dTransport: the production Transport over c10d process groups
// (gloo on CPU, NCCL on GPU, through the same code).
//
// Each value is one tensor sent with its own send/recv call (gloo moves one
// contiguous tensor per call). Receives allocate their tensors from the specs
// known at capture (shape, dtype, per stage edge and direction), so start-up
// needs no dry run and a sender whose tensor differs from its spec fails with
// an error naming both, before anything is sent (a std::invalid_argument, not
// a TransportError: the failure is the sender's own and its channels still
// work, NOTE [Draining a failed step] in executor.h).
//
// NOTE [Direction groups]: NCCL p2p matches by order on one communicator per
// rank pair, shared by both directions; the lowering orders each direction on
// its own (NOTE [Channel order]). So transfers a -> b with a < b go through
// `up`, the others through `down`: each communicator then carries one
// direction only. For gloo, which matches by (peer, tag) in FIFO order per
// direction, `up` and `down` may be the same group.
//
// NOTE [Host staging]: gloo's transports read and write host memory: given a
// CUDA tensor, its TCP pair hands the device pointer to writev, which fails
// ("Bad address"; seen on an H200 with torch 2.11). When the backend that
// carries the device's tensors is gloo (or there is none for that device),
// sends copy to host first and receives land in host tensors that wait()
// moves to the device: ranks sharing one GPU (NCCL refuses two ranks on one
// device) and gloo-only jobs then pipeline CUDA models, at the price of a
// copy each way. NCCL takes device tensors as they are.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <tuple>
#include <vector>

#include "runtime/transport.h"

namespace mpmd::runtime {

// Specs of the values of one stage edge and direction: meta (or any) tensors
// whose shape and dtype the transferred tensors have.
using EdgeKey = std::tuple<int, int, bool>;  // (producer, consumer, backward)
using EdgeSpecs = std::map<EdgeKey, std::vector<at::Tensor>>;
// Specs of one microbatch's values on one stage edge and direction, where
// they differ from the edge's (NOTE [Microbatch specs]).
using MicrobatchKey = std::tuple<int, int, bool, int>;  // (producer, consumer, backward, mb)
using MicrobatchSpecs = std::map<MicrobatchKey, std::vector<at::Tensor>>;

class C10dTransport : public Transport {
 public:
  // Ranks are group-local ranks of `up` and `down` (same ranks in both).
  // Received tensors are allocated on `device` (through host memory when
  // the groups' backend for it is gloo: NOTE [Host staging]).
  C10dTransport(c10::intrusive_ptr<c10d::ProcessGroup> up,
                c10::intrusive_ptr<c10d::ProcessGroup> down, EdgeSpecs specs, at::Device device,
                int tag = 0);

  std::unique_ptr<PendingTransfer> send(int peer, const TransferKey& key, Values values) override;
  std::unique_ptr<PendingTransfer> recv(int peer, const TransferKey& key) override;
  // Zeros of the captured shapes and dtypes, on the transport's device.
  std::unique_ptr<PendingTransfer> sendStandIn(int peer, const TransferKey& key) override;

  // NOTE [Microbatch specs]: every rank is given the same microbatches and
  // derives every transfer's shape from them, so no shape travels. A step
  // whose sizes differ from the last replaces the edge specs (setSpecs); a
  // step whose microbatches differ from one another (explicit microbatches)
  // also sets, for the microbatches that differ, their own specs, which
  // override the edge's until the next setMicrobatchSpecs. Both are called
  // between executor runs only (never while one runs).
  void setSpecs(EdgeSpecs specs) { specs_ = std::move(specs); }
  void setMicrobatchSpecs(MicrobatchSpecs specs) { mb_specs_ = std::move(specs); }

  int rank() const { return rank_; }
  bool stagesThroughHost() const { return host_staging_; }

 private:
  const std::vector<at::Tensor>& specsOf(const TransferKey& key, int peer) const;
  c10d::ProcessGroup& groupFor(int from, int to) const { return from < to ? *up_ : *down_; }

  c10::intrusive_ptr<c10d::ProcessGroup> up_, down_;
  EdgeSpecs specs_;
  MicrobatchSpecs mb_specs_;  // NOTE [Microbatch specs]
  at::Device device_;
  bool host_staging_;  // NOTE [Host staging]
  int tag_;
  int rank_;
};

}  // namespace mpmd::runtime
