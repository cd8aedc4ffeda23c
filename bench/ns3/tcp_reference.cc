// The reference TCP for bench/transport_fidelity.py: ns-3 3.37 (Debian's libns3-dev), not
// fedemu's model. N bulk transfers of S bytes from N senders to one receiver:
//
//   sender i --(access: rate, one-way delay, drop-tail buffer)--> core
//       --(shared: rate, one-way delay, drop-tail buffer)--> receiver
//
// or, without --bottleneckRate, sender i --(access)--> receiver i (N independent links).
// Per-packet loss: a RateErrorModel (packet unit) on the device that receives the access
// link's data, so data segments are lost and ACKs are not. Queues: the links' device
// queues (DropTailQueue of the given bytes), no queue disc, so each buffer is exactly
// the bytes given. TCP as ns-3 ships it (SACK, timestamps, delayed ACK every two
// segments, PRR, limited transmit, CUBIC with HyStart), with MSS 1448, initial window 10,
// the minimum RTO given (Linux's 200 ms by default; ns-3's own default is RFC 6298's
// 1 s), Linux's 40 ms delayed-ACK timer (ns-3's 200 ms equals that minimum RTO, so a
// window of one segment would time out before its ACK came) and send and receive buffers
// large enough that the receive window never limits. --dropSegments drops the first
// transmission of the listed segments (0-based) of flow 0, to compare recovery with the
// same losses in both.
//
// Prints one line per flow: "flow <i> <first data segment sent, s> <last byte received, s>
// <payload bytes sent, retransmissions included>", then "done <simulated s>"; with
// --trace, each flow's cwnd, ssthresh and congestion-state changes before them.
#include "ns3/applications-module.h"
#include "ns3/core-module.h"
#include "ns3/internet-module.h"
#include "ns3/network-module.h"
#include "ns3/point-to-point-module.h"
#include "ns3/ppp-header.h"
#include "ns3/traffic-control-module.h"

#include <cstdio>
#include <set>
#include <sstream>
#include <vector>

using namespace ns3;

namespace
{

struct Flow
{
    double firstData = -1;
    double lastByte = -1;
    uint64_t received = 0;
    uint64_t payloadSent = 0;
};

std::vector<Flow> flows;
uint64_t flowBytes = 0;
uint32_t pending = 0;

void
OnTx(uint32_t i, Ptr<const Packet> packet, const TcpHeader&, Ptr<const TcpSocketBase>)
{
    if (packet->GetSize() == 0)
    {
        return; // SYN, ACK, FIN: no payload
    }
    if (flows[i].firstData < 0)
    {
        flows[i].firstData = Simulator::Now().GetSeconds();
    }
    flows[i].payloadSent += packet->GetSize();
}

void
OnRx(uint32_t i, Ptr<const Packet> packet, const Address&)
{
    Flow& flow = flows[i];
    flow.received += packet->GetSize();
    if (flow.lastByte < 0 && flow.received >= flowBytes)
    {
        flow.lastByte = Simulator::Now().GetSeconds();
        if (--pending == 0)
        {
            Simulator::Stop();
        }
    }
}

bool trace = false;

void
OnCwnd(uint32_t i, uint32_t, uint32_t cwnd)
{
    std::printf("trace %u %.6f cwnd %u\n", i, Simulator::Now().GetSeconds(), cwnd / 1448);
}

void
OnState(uint32_t i, TcpSocketState::TcpCongState_t, TcpSocketState::TcpCongState_t state)
{
    std::printf("trace %u %.6f state %s\n",
                i,
                Simulator::Now().GetSeconds(),
                TcpSocketState::TcpCongStateName[state]);
}

void
OnSsthresh(uint32_t i, uint32_t, uint32_t ssthresh)
{
    std::printf("trace %u %.6f ssthresh %u\n", i, Simulator::Now().GetSeconds(), ssthresh / 1448);
}

void
HookSocket(uint32_t i, Ptr<BulkSendApplication> app)
{
    Ptr<TcpSocketBase> socket = DynamicCast<TcpSocketBase>(app->GetSocket());
    NS_ABORT_MSG_IF(!socket, "BulkSend has no TCP socket yet");
    socket->TraceConnectWithoutContext("Tx", MakeBoundCallback(&OnTx, i));
    if (trace)
    {
        socket->TraceConnectWithoutContext("CongestionWindow", MakeBoundCallback(&OnCwnd, i));
        socket->TraceConnectWithoutContext("CongState", MakeBoundCallback(&OnState, i));
        socket->TraceConnectWithoutContext("SlowStartThreshold", MakeBoundCallback(&OnSsthresh, i));
    }
}

// Drops the first transmission of chosen data segments (by TCP sequence number).
class SegmentErrorModel : public ErrorModel
{
  public:
    std::set<uint32_t> segments; // 0-based segment numbers
    uint32_t mss = 1448;

  private:
    bool DoCorrupt(Ptr<Packet> packet) override
    {
        Ptr<Packet> copy = packet->Copy();
        PppHeader ppp;
        Ipv4Header ip;
        TcpHeader tcp;
        copy->RemoveHeader(ppp);
        copy->RemoveHeader(ip);
        copy->RemoveHeader(tcp);
        if (copy->GetSize() == 0)
        {
            return false;
        }
        uint32_t segment = (tcp.GetSequenceNumber().GetValue() - 1) / mss;
        return segments.erase(segment) > 0; // only its first transmission
    }

    void DoReset() override
    {
    }
};

Ptr<DropTailQueue<Packet>>
DeviceQueue(Ptr<NetDevice> device)
{
    return DynamicCast<DropTailQueue<Packet>>(
        DynamicCast<PointToPointNetDevice>(device)->GetQueue());
}

} // namespace

int
main(int argc, char* argv[])
{
    std::string cc = "cubic";
    uint32_t numFlows = 1;
    std::string accessRate = "12Mbps";
    double accessDelayMs = 35;
    uint64_t accessBuffer = 150000;
    std::string bottleneckRate = "";
    double bottleneckDelayMs = 0;
    uint64_t bottleneckBuffer = 150000;
    double loss = 0;
    uint32_t run = 1;
    double minRto = 0.2;
    double delAckMs = 40;
    double startSpacing = 0;
    double stopAfter = 100000;
    uint32_t mss = 1448;
    bool hystart = true;
    std::string dropSegments = "";

    CommandLine cmd;
    cmd.AddValue("cc", "cubic or reno (ns-3's TcpLinuxReno)", cc);
    cmd.AddValue("flows", "number of senders", numFlows);
    cmd.AddValue("bytes", "bytes each sender transfers", flowBytes);
    cmd.AddValue("accessRate", "each access link's rate (ns-3 DataRate)", accessRate);
    cmd.AddValue("accessDelayMs", "each access link's one-way delay (ms)", accessDelayMs);
    cmd.AddValue("accessBuffer", "drop-tail bytes at each access link's sending device",
                 accessBuffer);
    cmd.AddValue("bottleneckRate", "shared link's rate; empty: no shared link", bottleneckRate);
    cmd.AddValue("bottleneckDelayMs", "shared link's one-way delay (ms)", bottleneckDelayMs);
    cmd.AddValue("bottleneckBuffer", "drop-tail bytes at the shared link", bottleneckBuffer);
    cmd.AddValue("loss", "per-packet loss probability of data on each access link", loss);
    cmd.AddValue("run", "RNG run number (the seed)", run);
    cmd.AddValue("minRto", "minimum RTO (s)", minRto);
    cmd.AddValue("delAckMs", "delayed-ACK timeout (ms)", delAckMs);
    cmd.AddValue("mss", "segment size (bytes)", mss);
    cmd.AddValue("dropSegments", "comma-separated segments of flow 0 to drop once", dropSegments);
    cmd.AddValue("trace", "print each flow's cwnd, ssthresh and state changes", trace);
    cmd.AddValue("hystart", "CUBIC's HyStart (ns-3's default: on)", hystart);
    cmd.AddValue("startSpacing", "sender i starts at i * startSpacing (s)", startSpacing);
    cmd.AddValue("stopAfter", "simulated seconds before giving up", stopAfter);
    cmd.Parse(argc, argv);
    NS_ABORT_MSG_IF(flowBytes == 0, "--bytes must be > 0");

    RngSeedManager::SetSeed(1);
    RngSeedManager::SetRun(run);
    Config::SetDefault("ns3::TcpL4Protocol::SocketType",
                       StringValue(cc == "reno" ? "ns3::TcpLinuxReno" : "ns3::TcpCubic"));
    Config::SetDefault("ns3::TcpCubic::HyStart", BooleanValue(hystart));
    Config::SetDefault("ns3::TcpSocket::SegmentSize", UintegerValue(mss));
    Config::SetDefault("ns3::TcpSocket::InitialCwnd", UintegerValue(10));
    Config::SetDefault("ns3::TcpSocket::SndBufSize", UintegerValue(1u << 30));
    Config::SetDefault("ns3::TcpSocket::RcvBufSize", UintegerValue(1u << 30));
    Config::SetDefault("ns3::TcpSocketBase::MinRto", TimeValue(Seconds(minRto)));
    // Linux's delayed-ACK timer starts at 40 ms (TCP_ATO_MIN).
    Config::SetDefault("ns3::TcpSocket::DelAckTimeout", TimeValue(MilliSeconds(delAckMs)));
    // A transfer that times out is a failure, not a result: let it retry as long as it takes.
    Config::SetDefault("ns3::TcpSocket::DataRetries", UintegerValue(100));

    NodeContainer senders;
    senders.Create(numFlows);
    Ptr<Node> core = CreateObject<Node>();
    NodeContainer receivers;
    receivers.Create(bottleneckRate.empty() ? numFlows : 1);
    InternetStackHelper stack;
    stack.Install(senders);
    stack.Install(core);
    stack.Install(receivers);

    PointToPointHelper access;
    access.SetDeviceAttribute("DataRate", StringValue(accessRate));
    access.SetChannelAttribute("Delay", TimeValue(MicroSeconds(accessDelayMs * 1000)));
    access.SetQueue("ns3::DropTailQueue",
                    "MaxSize",
                    QueueSizeValue(QueueSize(QueueSizeUnit::BYTES, accessBuffer)));

    Ipv4AddressHelper address;
    std::vector<Ipv4Address> sinkAddress(numFlows);
    std::vector<Ptr<Node>> sinkNode(numFlows);
    auto subnet = [&address](uint32_t a, uint32_t b) {
        std::ostringstream net;
        net << a << "." << (b / 250) << "." << (b % 250) << ".0";
        address.SetBase(Ipv4Address(net.str().c_str()), "255.255.255.0");
    };
    for (uint32_t i = 0; i < numFlows; ++i)
    {
        Ptr<Node> far = bottleneckRate.empty() ? receivers.Get(i) : core;
        NetDeviceContainer devices = access.Install(senders.Get(i), far);
        if (loss > 0)
        {
            Ptr<RateErrorModel> em = CreateObject<RateErrorModel>();
            em->SetUnit(RateErrorModel::ERROR_UNIT_PACKET);
            em->SetRate(loss);
            em->AssignStreams(1000 + i);
            devices.Get(1)->SetAttribute("ReceiveErrorModel", PointerValue(em));
        }
        if (i == 0 && !dropSegments.empty())
        {
            Ptr<SegmentErrorModel> em = CreateObject<SegmentErrorModel>();
            em->mss = mss;
            std::istringstream list(dropSegments);
            for (std::string item; std::getline(list, item, ',');)
            {
                em->segments.insert(std::stoul(item));
            }
            devices.Get(1)->SetAttribute("ReceiveErrorModel", PointerValue(em));
        }
        subnet(10, i);
        Ipv4InterfaceContainer ifs = address.Assign(devices);
        if (bottleneckRate.empty())
        {
            sinkAddress[i] = ifs.GetAddress(1);
            sinkNode[i] = far;
        }
    }
    if (!bottleneckRate.empty())
    {
        PointToPointHelper shared;
        shared.SetDeviceAttribute("DataRate", StringValue(bottleneckRate));
        shared.SetChannelAttribute("Delay", TimeValue(MicroSeconds(bottleneckDelayMs * 1000)));
        shared.SetQueue("ns3::DropTailQueue",
                        "MaxSize",
                        QueueSizeValue(QueueSize(QueueSizeUnit::BYTES, bottleneckBuffer)));
        NetDeviceContainer devices = shared.Install(core, receivers.Get(0));
        subnet(12, 0);
        Ipv4InterfaceContainer ifs = address.Assign(devices);
        for (uint32_t i = 0; i < numFlows; ++i)
        {
            sinkAddress[i] = ifs.GetAddress(1);
            sinkNode[i] = receivers.Get(0);
        }
    }
    // Ipv4AddressHelper::Assign gave every device ns-3's default queue disc (FqCoDel):
    // take them off, so each link's buffer is its drop-tail device queue alone.
    TrafficControlHelper noQueueDisc;
    for (NodeList::Iterator node = NodeList::Begin(); node != NodeList::End(); ++node)
    {
        for (uint32_t d = 0; d < (*node)->GetNDevices(); ++d)
        {
            Ptr<NetDevice> device = (*node)->GetDevice(d);
            if (!DynamicCast<LoopbackNetDevice>(device))
            {
                noQueueDisc.Uninstall(device);
            }
        }
    }
    Ipv4GlobalRoutingHelper::PopulateRoutingTables();

    flows.resize(numFlows);
    pending = numFlows;
    for (uint32_t i = 0; i < numFlows; ++i)
    {
        uint16_t port = 5000 + i;
        PacketSinkHelper sinkHelper("ns3::TcpSocketFactory",
                                    InetSocketAddress(Ipv4Address::GetAny(), port));
        ApplicationContainer sinkApp = sinkHelper.Install(sinkNode[i]);
        sinkApp.Start(Seconds(0));
        DynamicCast<PacketSink>(sinkApp.Get(0))
            ->TraceConnectWithoutContext("Rx", MakeBoundCallback(&OnRx, i));

        BulkSendHelper bulk("ns3::TcpSocketFactory", InetSocketAddress(sinkAddress[i], port));
        bulk.SetAttribute("MaxBytes", UintegerValue(flowBytes));
        bulk.SetAttribute("SendSize", UintegerValue(mss * 64));
        ApplicationContainer app = bulk.Install(senders.Get(i));
        double start = i * startSpacing;
        app.Start(Seconds(start));
        // The socket exists once the application started; hook it before its SYN is answered.
        Simulator::Schedule(Seconds(start) + NanoSeconds(1),
                            &HookSocket,
                            i,
                            DynamicCast<BulkSendApplication>(app.Get(0)));
    }

    Simulator::Stop(Seconds(stopAfter));
    Simulator::Run();
    for (uint32_t i = 0; i < numFlows; ++i)
    {
        std::printf("flow %u %.9f %.9f %llu\n",
                    i,
                    flows[i].firstData,
                    flows[i].lastByte,
                    static_cast<unsigned long long>(flows[i].payloadSent));
    }
    std::printf("done %.9f\n", Simulator::Now().GetSeconds());
    Simulator::Destroy();
    return pending == 0 ? 0 : 2;
}
