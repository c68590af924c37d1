// MemoryTransport: ranks as threads of one process, for the executor tests.
//
// A MemoryNetwork holds one FIFO per directed rank channel; each rank's
// MemoryTransport sends into and receives from it. Sends are buffered (they
// complete at once); the k-th receive posted on a channel takes the k-th
// message (NOTE [Transport ordering]) and checks that its key is the expected
// one, so a lowering that breaks channel order fails loudly here. Faults can
// be injected: a failing send, or a rank marked dead (what abort() does).
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "runtime/transport.h"

namespace mpmd::runtime {

class MemoryNetwork {
 public:
  explicit MemoryNetwork(int num_ranks);
  int numRanks() const { return num_ranks_; }

  // The `nth` send (0-based, counted per rank) that `rank` posts fails with a
  // TransportError naming the peer.
  void failSend(int rank, int nth);
  // Marks `rank` dead: receives waiting on it fail at once with `reason`.
  void kill(int rank, const std::string& reason);
  // Messages sent but not yet received, over all channels (tests check 0).
  size_t inFlight() const;

 private:
  friend class MemoryTransport;
  friend class MemoryRecv;
  struct Message {
    TransferKey key;
    Values values;
  };
  struct Channel {
    std::vector<std::optional<Message>> messages;  // by sequence number
    size_t sent = 0;
    size_t posted = 0;
  };
  Channel& channel(int from, int to) { return channels_[static_cast<size_t>(from) * num_ranks_ + to]; }

  int num_ranks_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Channel> channels_;
  std::vector<std::optional<std::string>> dead_;  // reason, per rank
  std::map<int, int> fail_send_at_;               // rank -> nth send
  std::vector<int> sends_posted_;
};

class MemoryTransport : public Transport {
 public:
  MemoryTransport(std::shared_ptr<MemoryNetwork> network, int rank);
  std::unique_ptr<PendingTransfer> send(int peer, const TransferKey& key, Values values) override;
  std::unique_ptr<PendingTransfer> recv(int peer, const TransferKey& key) override;
  // An empty Values under the right key (the executor never looks inside).
  std::unique_ptr<PendingTransfer> sendStandIn(int peer, const TransferKey& key) override;
  void abort(const std::string& reason) noexcept override;

 private:
  std::shared_ptr<MemoryNetwork> network_;
  int rank_;
};

}  // namespace mpmd::runtime
