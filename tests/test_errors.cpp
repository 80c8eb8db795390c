// Bad input gets a clear std::invalid_argument naming the shapes, in every build type.
#include <sdpa/sdpa.hpp>

#include <stdexcept>

#include "support/cases.hpp"

using namespace sdpa_test;
using Catch::Matchers::Contains;

TEST_CASE("shape mismatches name the shapes", "[errors]") {
  const Mat<float> q = Mat<float>::Ones(3, 4), k = Mat<float>::Ones(5, 4), v = Mat<float>::Ones(5, 2);
  CHECK_THROWS_WITH(sdpa::attention(q, Mat<float>::Ones(5, 6), v),
                    Contains("q is 3x4 and k is 5x6") && Contains("same number of columns (d_k)"));
  CHECK_THROWS_WITH(sdpa::attentionForward(q, k, Mat<float>::Ones(6, 2)),
                    Contains("sdpa::attentionForward") && Contains("k is 5x4 and v is 6x2"));
  CHECK_THROWS_AS(sdpa::scaledDotProductAttention(q, k, Mat<float>::Ones(4, 2)), std::invalid_argument);
  CHECK_THROWS_AS(sdpa::dotProductAttention(q, Mat<float>::Ones(5, 3), v), std::invalid_argument);
  CHECK_THROWS_WITH(sdpa::attentionLogits(q, Mat<float>::Ones(5, 6)), Contains("q is 3x4 and k is 5x6"));
  CHECK_THROWS_WITH(sdpa::attentionWeights(Mat<float>::Ones(3, 2), k), Contains("q is 3x2 and k is 5x4"));
}

TEST_CASE("mask shape mismatches name both shapes", "[errors][mask]") {
  const Mat<double> q = Mat<double>::Ones(3, 4), k = Mat<double>::Ones(5, 4), v = Mat<double>::Ones(5, 2);
  const Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> keep =
      Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic>::Constant(3, 4, true);
  CHECK_THROWS_WITH(sdpa::attention(q, k, v, sdpa::scale::None{}, sdpa::mask::Keep{keep}),
                    Contains("the Keep mask is 3x4 but the logits are 3x5"));
  const Mat<double> bias = Mat<double>::Zero(5, 3);
  CHECK_THROWS_WITH(sdpa::attention(q, k, v, sdpa::scale::None{}, sdpa::mask::Bias{bias}),
                    Contains("the Bias is 5x3 but the logits are 3x5"));
  CHECK_THROWS_AS(sdpa::attentionWeights(q, k, sdpa::scale::None{}, sdpa::mask::Bias{bias}), std::invalid_argument);
}

TEST_CASE("softmaxJacobianVjp rejects vectors of different lengths", "[errors][softmax]") {
  CHECK_THROWS_WITH(sdpa::softmaxJacobianVjp(Eigen::VectorXd::Ones(3), Eigen::VectorXd::Ones(4)),
                    Contains("p has 3 entries but g has 4"));
}
