#include <sdpa/sdpa.hpp>
int main() {
  sdpa::scale::Learnable<int> tau;
  return tau.hasValue() ? 1 : 0;
}
