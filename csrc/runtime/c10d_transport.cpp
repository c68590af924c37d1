#include "runtime/c10d_transport.h"

#include <ATen/ATen.h>

#include <optional>
#include <sstream>
#include <stdexcept>

#include "runtime/tensor_payload.h"

namespace mpmd::runtime {

namespace {

std::string shapeOf(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << t.scalar_type();
  return out.str();
}

// NOTE [Host staging] in c10d_transport.h.
bool needsHostStaging(c10d::ProcessGroup& pg, at::Device device) {
  if (device.is_cpu() || device.is_meta()) return false;
  try {  // (hasBackendForDeviceType is not in every torch release)
    return pg.getBackend(device.type())->getBackendName() == "gloo";
  } catch (const std::exception&) {
    return true;  // no backend for the device: its tensors go through the CPU one
  }
}

// Waits on every work of one transfer; c10d reports failures and timeouts by
// throwing, which becomes a TransportError naming the peer. With `to_device`
// (a staged receive) the values move there once received.
class C10dPending : public PendingTransfer {
 public:
  C10dPending(int peer, std::string what, std::vector<c10::intrusive_ptr<c10d::Work>> works,
              Values values, std::optional<at::Device> to_device = std::nullopt)
      : peer_(peer), what_(std::move(what)), works_(std::move(works)), values_(std::move(values)),
        to_device_(to_device) {}

  Values wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    try {
      for (auto& work : works_) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() < 1) left = std::chrono::milliseconds(1);
        if (!work->wait(left)) {
          throw std::runtime_error("timed out");
        }
      }
    } catch (const std::exception& e) {
      std::string msg = e.what();
      if (msg.size() > 600) msg = msg.substr(0, 600) + "...";
      throw TransportError(peer_, what_ + " failed within " + std::to_string(timeout.count()) +
                                      " ms timeout: " + msg);
    }
    works_.clear();
    if (to_device_) {
      for (auto& v : values_) v = tensorValue(tensorOf(v).to(*to_device_));
      to_device_.reset();
    }
    return std::move(values_);
  }

  bool poll() override {
    try {
      for (auto& work : works_) {
        if (!work->isCompleted()) return false;
        if (!work->isSuccess()) work->wait();  // rethrows the failure
      }
    } catch (const std::exception& e) {
      throw TransportError(peer_, what_ + " failed: " + e.what());
    }
    return true;
  }

 private:
  int peer_;
  std::string what_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  Values values_;  // received values, or sent ones kept alive until done
  std::optional<at::Device> to_device_;
};

}  // namespace

C10dTransport::C10dTransport(c10::intrusive_ptr<c10d::ProcessGroup> up,
                             c10::intrusive_ptr<c10d::ProcessGroup> down, EdgeSpecs specs,
                             at::Device device, int tag)
    : up_(std::move(up)), down_(std::move(down)), specs_(std::move(specs)), device_(device),
      host_staging_(needsHostStaging(*up_, device) || needsHostStaging(*down_, device)),
      tag_(tag), rank_(up_->getRank()) {
  TORCH_CHECK(down_->getRank() == rank_ && down_->getSize() == up_->getSize(),
              "the up and down process groups must hold the same ranks (rank ", rank_, " of ",
              up_->getSize(), " vs rank ", down_->getRank(), " of ", down_->getSize(), ")");
}

const std::vector<at::Tensor>& C10dTransport::specsOf(const TransferKey& key, int peer) const {
  if (!mb_specs_.empty()) {
    auto own = mb_specs_.find({key.producer, key.consumer, key.backward, key.microbatch});
    if (own != mb_specs_.end()) return own->second;
  }
  auto it = specs_.find({key.producer, key.consumer, key.backward});
  if (it == specs_.end()) {
    throw TransportError(peer, "no tensor specs for " + describe(key) +
                                   " (the transport was built for another plan)");
  }
  return it->second;
}

std::unique_ptr<PendingTransfer> C10dTransport::send(int peer, const TransferKey& key,
                                                     Values values) {
  const auto& specs = specsOf(key, peer);
  const std::string what = "send of " + describe(key) + " to rank " + std::to_string(peer);
  if (values.size() != specs.size()) {
    throw std::invalid_argument(what + ": " + std::to_string(values.size()) +
                                " tensors, the captured plan has " +
                                std::to_string(specs.size()));
  }
  for (size_t i = 0; i < values.size(); ++i) {  // all checked before anything is sent
    const at::Tensor& t = tensorOf(values[i]);
    if (t.sizes() != specs[i].sizes() || t.scalar_type() != specs[i].scalar_type()) {
      throw std::invalid_argument(what + ": tensor " + std::to_string(i) + " is " +
                                  shapeOf(t) + ", the plan captured " + shapeOf(specs[i]) +
                                  "; the batch differs from the one captured");
    }
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  Values keep;
  for (size_t i = 0; i < values.size(); ++i) {
    const at::Tensor& t = tensorOf(values[i]);
    at::Tensor c = host_staging_ && !t.is_cpu() ? t.to(at::kCPU).contiguous()
                   : t.is_contiguous()         ? t
                                               : t.contiguous();
    std::vector<at::Tensor> one{c};
    works.push_back(groupFor(rank_, peer).send(one, peer, tag_));
    keep.push_back(c.is_same(t) ? values[i] : tensorValue(c));
  }
  return std::make_unique<C10dPending>(peer, what, std::move(works), std::move(keep));
}

std::unique_ptr<PendingTransfer> C10dTransport::sendStandIn(int peer, const TransferKey& key) {
  Values zeros;
  for (const at::Tensor& spec : specsOf(key, peer)) {
    zeros.push_back(tensorValue(at::zeros(spec.sizes(), spec.options().device(device_))));
  }
  return send(peer, key, std::move(zeros));
}

std::unique_ptr<PendingTransfer> C10dTransport::recv(int peer, const TransferKey& key) {
  const auto& specs = specsOf(key, peer);
  const std::string what = "receive of " + describe(key) + " from rank " + std::to_string(peer);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  Values values;
  for (const at::Tensor& spec : specs) {
    const at::Device lands = host_staging_ ? at::Device(at::kCPU) : device_;
    at::Tensor t = at::empty(spec.sizes(), spec.options().device(lands));
    std::vector<at::Tensor> one{t};
    works.push_back(groupFor(peer, rank_).recv(one, peer, tag_));
    values.push_back(tensorValue(std::move(t)));
  }
  std::optional<at::Device> to_device;
  if (host_staging_) to_device = device_;
  return std::make_unique<C10dPending>(peer, what, std::move(works), std::move(values), to_device);
}

}  // namespace mpmd::runtime
