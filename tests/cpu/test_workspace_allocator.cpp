// The entry points that take a WorkspaceAllocator (dsaib/workspace.hpp), on the
// cpu backend: the same results and errors as the plain calls, the allocator
// never asked (the cpu backend needs no workspace); and the check of what an
// allocator returns (api/workspace_allocator.hpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "api/workspace_allocator.hpp"
#include "dsaib/workspace.hpp"
#include "support/attention_target_check.hpp"
#include "support/kl_forward_check.hpp"

namespace dsaib::test {
namespace {

struct Counting {
  int calls = 0;
  std::size_t last = 0;
  void* result = nullptr;
};

void* counting_allocate(void* context, std::size_t bytes) {
  auto* c = static_cast<Counting*>(context);
  ++c->calls;
  c->last = bytes;
  return c->result;
}

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() && std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

GeneratedProblem thd_problem() {
  GenerateSpec s = small_spec(7);
  s.layout = Layout::thd;
  s.seqlens_q = {9, 0, 5};
  s.seqlens_k = {20, 4, 11};
  return make_problem(s);
}

TEST(WorkspaceAllocator, CpuBackendGivesThePlainCallsResultsWithoutAsking) {
  for (const GeneratedProblem& p : {make_problem(small_spec(3)), thd_problem()}) {
    Counting c;
    const WorkspaceAllocator allocator{&counting_allocate, &c};
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.8f;

    OutputBuffers plain = make_outputs(p), given = make_outputs(p);
    indexer_backward(p.inputs(), plain.views(), opt);
    indexer_backward(p.inputs(), given.views(), opt, allocator);
    EXPECT_TRUE(same_bytes(plain.d_index_q, given.d_index_q));
    EXPECT_TRUE(same_bytes(plain.d_weights, given.d_weights));
    EXPECT_TRUE(same_bytes(plain.d_index_k, given.d_index_k));

    ForwardBuffers f1 = make_forward_buffers(p), f2 = make_forward_buffers(p);
    indexer_kl_forward(forward_inputs(p), f1.views(), opt);
    indexer_kl_forward(forward_inputs(p), f2.views(), opt, allocator);
    EXPECT_TRUE(same_bytes(f1.loss, f2.loss));
    EXPECT_TRUE(same_bytes(f1.row_lse, f2.row_lse));
    EXPECT_TRUE(same_bytes(f1.index_score, f2.index_score));

    HostTensor l1(DType::f32, {}), l2(DType::f32, {});
    OutputBuffers g1 = make_outputs(p), g2 = make_outputs(p);
    indexer_kl_loss_and_grad(forward_inputs(p), {l1.view(), g1.d_index_q.view(), g1.d_weights.view(),
                                                 g1.d_index_k.view()}, opt);
    indexer_kl_loss_and_grad(forward_inputs(p), {l2.view(), g2.d_index_q.view(), g2.d_weights.view(),
                                                 g2.d_index_k.view()}, opt, allocator);
    EXPECT_TRUE(same_bytes(l1, l2));
    EXPECT_TRUE(same_bytes(g1.d_index_k, g2.d_index_k));
    EXPECT_EQ(c.calls, 0);
  }
  TargetSpec ts;
  const TargetProblem t = make_target_problem(ts);
  Counting c;
  HostTensor a = t.make_output(), b = t.make_output();
  attention_target(t.inputs(), {a.view()}, t.options());
  attention_target(t.inputs(), {b.view()}, t.options(), WorkspaceAllocator{&counting_allocate, &c});
  EXPECT_TRUE(same_bytes(a, b));
  EXPECT_EQ(c.calls, 0);
}

TEST(WorkspaceAllocator, ErrorsAreThePlainCallsAndComeBeforeTheAllocator) {
  GeneratedProblem p = make_problem(small_spec(4));
  Counting c;
  IndexerOptions opt = p.options();
  opt.sm_scale = std::numeric_limits<float>::infinity();
  OutputBuffers o = make_outputs(p);
  poison(o);
  const SnapshotAll before(p, o);
  std::string plain, given;
  try {
    indexer_backward(p.inputs(), o.views(), opt);
  } catch (const Error& e) {
    plain = e.what();
  }
  try {
    indexer_backward(p.inputs(), o.views(), opt, WorkspaceAllocator{&counting_allocate, &c});
  } catch (const Error& e) {
    given = e.what();
  }
  EXPECT_EQ(plain, "sm_scale: expected a finite value, got inf");
  EXPECT_EQ(given, plain);
  EXPECT_EQ(c.calls, 0);
  EXPECT_EQ(before.changed(), "");
}

TEST(WorkspaceAllocator, WhatTheAllocatorReturnsIsChecked) {
  alignas(256) static unsigned char block[512];
  Counting c;
  c.result = block;
  const WorkspaceAllocator allocator{&counting_allocate, &c};
  EXPECT_EQ(detail::allocate_workspace(allocator, 0), nullptr);  // nothing needed: not asked
  EXPECT_EQ(c.calls, 0);
  EXPECT_EQ(detail::allocate_workspace(allocator, 300), block);
  EXPECT_EQ(c.calls, 1);
  EXPECT_EQ(c.last, 300u);
  EXPECT_EQ(detail::allocate_workspace(WorkspaceAllocator{}, 300), nullptr);  // left to the call

  for (void* bad : {static_cast<void*>(nullptr), static_cast<void*>(block + 16)}) {
    c.result = bad;
    try {
      detail::allocate_workspace(allocator, 300);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(e.argument(), "workspace");
      EXPECT_EQ(std::string(e.what()),
                std::string("workspace: expected the allocator to return a non-null 256-byte aligned device "
                            "pointer to 300 bytes, got ") + (bad ? "a misaligned pointer" : "null"));
    }
  }
}

}  // namespace
}  // namespace dsaib::test
