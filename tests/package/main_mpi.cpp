// A consumer of sdpa::mpi: ring attention over the ranks of MPI_COMM_WORLD (built, not run: it
// needs mpirun).
#include <mpi.h>

#include <cstdio>
#include <sdpa/distributed.hpp>

int main(int argc, char** argv) {
  int provided = 0, rank = 0, ranks = 1;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const auto split = sdpa::distributed::Split::contiguous(64, ranks);
  const Eigen::Index n = split.localRows(rank);
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(n, 32), k = Eigen::MatrixXf::Random(n, 32),
                        v = Eigen::MatrixXf::Random(n, 32);
  const auto out = sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q, k, v, sdpa::Heads{2}, split, split,
                                                           sdpa::scale::InvSqrtDk{},
                                                           sdpa::mask::Causal{sdpa::mask::Align::UpperLeft});
  std::printf("rank %d: %d x %d output\n", rank, int(out.output.rows()), int(out.output.cols()));
  MPI_Finalize();
  return 0;
}
