#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <map>

#include "comm/store.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"
#include "mfsdp/launch/rank_processes.h"

namespace {

mfsdp::RendezvousInfo read(const std::map<std::string, std::string>& vars) {
  return mfsdp::rendezvous_from_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

void expect_error(const std::map<std::string, std::string>& vars, const std::string& part) {
  try {
    read(vars);
    ADD_FAILURE() << "expected an error mentioning '" << part << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Rendezvous, Torchrun) {
  auto info = read({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "10.0.0.1");
  EXPECT_EQ(info.master_port, 1234);
  EXPECT_FALSE(info.single_node());
}

TEST(Rendezvous, TorchrunSingleProcessNeedsNoAddress) {
  auto info = read({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_TRUE(info.single_node());
  EXPECT_EQ(info.master_addr, "127.0.0.1");
}

TEST(Rendezvous, TorchrunErrorsNameTheVariable) {
  expect_error({{"RANK", "0"}}, "WORLD_SIZE is not set");
  expect_error({{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, "RANK='x'");
  expect_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, "rank 2 is outside");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, "MASTER_PORT is not set");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "master port 70000");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                {"MASTER_PORT", "5"}}, "local rank 2");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_PORT", "5"}},
               "MASTER_ADDR is not set");
}

TEST(Rendezvous, Slurm) {
  auto info = read({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                    {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                    {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, 20000 + 123456 % 20000);
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "SLURM_LOCALID is not set");
}

TEST(Rendezvous, OpenMpi) {
  auto info = read({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                    {"MASTER_PORT", "4000"}});
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_EQ(info.master_port, 4000);
  expect_error({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
               "needs MASTER_ADDR");
}

TEST(Rendezvous, NothingSetSaysHowToLaunch) { expect_error({}, "mfsdp-run"); }

TEST(Rendezvous, FirstSlurmHost) {
  EXPECT_EQ(mfsdp::first_slurm_host("node01"), "node01");
  EXPECT_EQ(mfsdp::first_slurm_host("node[03-05,9],gpu1"), "node03");
  EXPECT_EQ(mfsdp::first_slurm_host("a,b[1-2]"), "a");
  EXPECT_EQ(mfsdp::first_slurm_host("rack1-n[7,9]"), "rack1-n7");
}

// The job token: MFSDP_JOB_TOKEN first, then torchrun's run id (not its default "none"), then
// Slurm's job and step; none gives an empty token, and one past the limit is an error.
TEST(Rendezvous, JobTokenSources) {
  const std::map<std::string, std::string> base = {{"RANK", "0"}, {"WORLD_SIZE", "2"},
                                                   {"MASTER_PORT", "1234"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    extra.insert(base.begin(), base.end());
    return read(extra).job_token;
  };
  EXPECT_EQ(with({}), "");
  EXPECT_EQ(with({{"MFSDP_JOB_TOKEN", "abc"}, {"TORCHELASTIC_RUN_ID", "r"}, {"SLURM_JOB_ID", "7"}}), "abc");
  EXPECT_EQ(with({{"TORCHELASTIC_RUN_ID", "r"}, {"SLURM_JOB_ID", "7"}}), "torchrun:r");
  EXPECT_EQ(with({{"TORCHELASTIC_RUN_ID", "none"}, {"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "2"}}),
            "slurm:7.2");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MFSDP_JOB_TOKEN", std::string(1025, 't')}},
               "MFSDP_JOB_TOKEN");
}

TEST(Rendezvous, TorchrunAgentStoreAndRestartCount) {
  const std::map<std::string, std::string> base = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    extra.insert(base.begin(), base.end());
    return read(extra);
  };
  EXPECT_FALSE(with({}).agent_store);
  EXPECT_EQ(with({}).restart_count, 0);
  // torch's own test of the variable: exactly "True".
  EXPECT_FALSE(with({{"TORCHELASTIC_USE_AGENT_STORE", "False"}}).agent_store);
  const auto info = with({{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"},
                          {"TORCHELASTIC_MAX_RESTARTS", "3"}});
  EXPECT_TRUE(info.agent_store);
  EXPECT_EQ(info.restart_count, 2);
  EXPECT_EQ(info.max_restarts, 3);
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"TORCHELASTIC_RESTART_COUNT", "-1"}},
               "TORCHELASTIC_RESTART_COUNT=-1 is outside");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"TORCHELASTIC_RESTART_COUNT", "one"}},
               "TORCHELASTIC_RESTART_COUNT='one'");
}

// Under torchrun's agent store every rank is a client of a c10d TCPStore (here LibTorch's own
// server, as torchrun's agent runs it), and the keys of one start are not seen by the next: the
// store outlives the workers of a start that died, and a restart reading their addresses would
// dial processes that are gone. An agent store that does not answer is a CommError naming it.
TEST(Rendezvous, AgentStoreKeepsEachStartsKeysApart) {
  c10d::TCPStoreOptions server_options;
  server_options.port = 0;  // any free port
  server_options.isServer = true;
  server_options.waitWorkers = false;
  c10d::TCPStore server("127.0.0.1", server_options);
  mfsdp::RendezvousInfo info;
  info.world_size = 2;
  info.rank = 1;
  info.master_addr = "127.0.0.1";
  info.master_port = server.getPort();
  info.agent_store = true;
  const auto first = mfsdp::connect_store(info, std::chrono::seconds(10));
  first->set("address/0", std::vector<uint8_t>{'a'});
  info.restart_count = 1;
  const auto second = mfsdp::connect_store(info, std::chrono::seconds(10));
  EXPECT_FALSE(second->check({"address/0"}));
  second->set("address/0", std::vector<uint8_t>{'b'});
  EXPECT_EQ(first->get("address/0"), std::vector<uint8_t>{'a'});
  EXPECT_EQ(second->get("address/0"), std::vector<uint8_t>{'b'});

  info.master_port = mfsdp::launch::pick_free_port();  // nothing listens there
  try {
    mfsdp::connect_store(info, std::chrono::seconds(2));
    ADD_FAILURE() << "connected to a store that does not exist";
  } catch (const mfsdp::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 could not reach torchrun's store at 127.0.0.1:" +
                                         std::to_string(info.master_port)),
              std::string::npos)
        << e.what();
  }
}
