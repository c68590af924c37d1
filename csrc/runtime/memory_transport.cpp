#include "runtime/memory_transport.h"

#include <fmt/format.h>

namespace mpmd::runtime {

namespace {

class DoneSend : public PendingTransfer {
 public:
  Values wait(std::chrono::milliseconds) override { return {}; }
  bool poll() override { return true; }
};

class FailedSend : public PendingTransfer {
 public:
  FailedSend(int peer, std::string what) : peer_(peer), what_(std::move(what)) {}
  Values wait(std::chrono::milliseconds) override { throw TransportError(peer_, what_); }
  bool poll() override { throw TransportError(peer_, what_); }

 private:
  int peer_;
  std::string what_;
};

}  // namespace

class MemoryRecv : public PendingTransfer {
 public:
  MemoryRecv(std::shared_ptr<MemoryNetwork> net, int from, int to, size_t seq, TransferKey key)
      : net_(std::move(net)), from_(from), to_(to), seq_(seq), key_(key) {}

  Values wait(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(net_->mu_);
    auto& ch = net_->channel(from_, to_);
    const bool ready = net_->cv_.wait_for(lock, timeout, [&] {
      return (ch.messages.size() > seq_ && ch.messages[seq_]) || net_->dead_[from_];
    });
    if (ch.messages.size() > seq_ && ch.messages[seq_]) return takeLocked(ch);
    if (net_->dead_[from_]) {
      throw TransportError(from_, fmt::format("receive of {} from rank {}: peer rank {} failed: {}",
                                              describe(key_), from_, from_, *net_->dead_[from_]));
    }
    (void)ready;
    throw TransportError(from_, fmt::format("receive of {} from rank {} timed out after {} ms",
                                            describe(key_), from_, timeout.count()));
  }

  bool poll() override {
    std::lock_guard lock(net_->mu_);
    auto& ch = net_->channel(from_, to_);
    return ch.messages.size() > seq_ && ch.messages[seq_].has_value();
  }

 private:
  Values takeLocked(MemoryNetwork::Channel& ch) {
    MemoryNetwork::Message msg = std::move(*ch.messages[seq_]);
    ch.messages[seq_].reset();
    if (!(msg.key == key_)) {
      throw TransportError(from_, fmt::format(
          "channel order broken: rank {} expected {} from rank {} as message #{}, got {}", to_,
          describe(key_), from_, seq_, describe(msg.key)));
    }
    return std::move(msg.values);
  }

  std::shared_ptr<MemoryNetwork> net_;
  int from_, to_;
  size_t seq_;
  TransferKey key_;
};

MemoryNetwork::MemoryNetwork(int num_ranks)
    : num_ranks_(num_ranks),
      channels_(static_cast<size_t>(num_ranks) * num_ranks),
      dead_(num_ranks),
      sends_posted_(num_ranks, 0) {}

void MemoryNetwork::failSend(int rank, int nth) {
  std::lock_guard lock(mu_);
  fail_send_at_[rank] = nth;
}

void MemoryNetwork::kill(int rank, const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (!dead_[rank]) dead_[rank] = reason;
  }
  cv_.notify_all();
}

size_t MemoryNetwork::inFlight() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& ch : channels_) {
    for (const auto& m : ch.messages) n += m.has_value() ? 1 : 0;
  }
  return n;
}

MemoryTransport::MemoryTransport(std::shared_ptr<MemoryNetwork> network, int rank)
    : network_(std::move(network)), rank_(rank) {}

std::unique_ptr<PendingTransfer> MemoryTransport::send(int peer, const TransferKey& key,
                                                       Values values) {
  auto& net = *network_;
  {
    std::lock_guard lock(net.mu_);
    const int nth = net.sends_posted_[rank_]++;
    auto fault = net.fail_send_at_.find(rank_);
    if (fault != net.fail_send_at_.end() && fault->second == nth) {
      return std::make_unique<FailedSend>(
          peer, fmt::format("injected failure of send #{} ({}) to rank {}", nth, describe(key), peer));
    }
    auto& ch = net.channel(rank_, peer);
    if (ch.messages.size() <= ch.sent) ch.messages.resize(ch.sent + 1);
    ch.messages[ch.sent++] = MemoryNetwork::Message{key, std::move(values)};
  }
  net.cv_.notify_all();
  return std::make_unique<DoneSend>();
}

std::unique_ptr<PendingTransfer> MemoryTransport::recv(int peer, const TransferKey& key) {
  std::lock_guard lock(network_->mu_);
  const size_t seq = network_->channel(peer, rank_).posted++;
  return std::make_unique<MemoryRecv>(network_, peer, rank_, seq, key);
}

std::unique_ptr<PendingTransfer> MemoryTransport::sendStandIn(int peer, const TransferKey& key) {
  return send(peer, key, Values{});
}

void MemoryTransport::abort(const std::string& reason) noexcept {
  try {
    network_->kill(rank_, reason.substr(0, reason.find('\n')));
  } catch (...) {  // abort never throws (transport.h)
  }
}

}  // namespace mpmd::runtime
